"""The Redis calls of a worker's heartbeat: its lease written or renewed, and a given-up boot's records
dropped, on a connection of the heartbeat's own whose every call is bounded (``bounded.py``)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from typing import Any

import redis
from django.core.exceptions import ImproperlyConfigured

from celery_orphans import leases, logs, processes, scripts
from celery_orphans.conf import settings
from celery_orphans.store import Keys, address, client
from celery_orphans.worker import presence as presence_
from celery_orphans.worker.bounded import Line

logger = logs.get(__name__)
HOST = socket.gethostname()
RENEW_SHA = hashlib.sha1(scripts.RENEW.encode()).hexdigest()
# How the heartbeat's own connection shows in Redis's CLIENT LIST.
HEARTBEAT_CLIENT_NAME = "celery-orphans-heartbeat"


class Renewals:
    """Writes the lease of ``node``'s boots from this process, each call within the seconds given."""

    def __init__(self, node: str, lease_seconds: float) -> None:
        self.node = node
        self.lease_seconds = lease_seconds
        self.pid = os.getpid()
        self.process = processes.this()
        self.machine = self.process.machine if self.process else None
        self.keys = Keys.current()
        self._line: Line | None = None
        self.presence: presence_.Presence | None = None  # its process's presence, recorded by each renewal

    def write(self, boot: str, *, first: bool, limit: int, seconds: float) -> leases.Seen | None:
        """Write the lease of ``boot`` (take it, if ``first``); what the renewal saw of other boots (up to
        ``limit`` lapsed ones), or ``None`` if the lease was not written (it is gone)."""
        process = self.process
        value = json.dumps(
            {
                "node": self.node,
                "boot": boot,
                "pid": self.pid,
                "host": HOST,
                "machine": self.machine,
                "process": str(process) if process else None,
                "renewed_at": time.time(),
            }
        )
        # Without a process to record, the script leaves its fourth key alone: any key of ours will do.
        machine = self.keys.machine(self.machine) if self.machine else self.keys.watch
        keys = [self.keys.lease(self.node, boot), self.keys.boots(self.node), self.keys.watch, machine]
        member = leases.member(self.node, boot)
        lease_ms = int(self.lease_seconds * 1000)
        args = [value, lease_ms, boot, "1" if first else "0", member, str(process or ""), limit]
        present = self.presence.commands(member, watching=limit > 0) if self.presence else []
        reply, *presence = self._call([("EVALSHA", RENEW_SHA, len(keys), *keys, *args), *present], seconds)
        if isinstance(reply, redis.exceptions.NoScriptError):  # Redis lost its scripts (a restart)
            calls = [("EVAL", scripts.RENEW, len(keys), *keys, *args)]
            reply, *presence = self._call(
                calls + (self.presence.script(present) if self.presence else []), seconds
            )
        elif self.presence and any(isinstance(r, redis.exceptions.NoScriptError) for r in presence):
            presence = self._call(self.presence.script(present), seconds)
        if isinstance(reply, redis.RedisError):
            raise reply
        if not reply[0]:
            return None
        seen = leases.Seen.from_reply(reply, self.machine, (self.node, boot))
        if self.presence is None or not presence:
            return seen
        return presence_.missing_after(seen, self.presence.heard(presence[0]))

    def drop(self, boot: str, seconds: float) -> None:
        """Remove every record of ``boot`` (``leases.drop``), within ``seconds``."""
        for reply in self._call(leases.drop_commands(self.keys, self.node, boot, self.machine), seconds):
            if isinstance(reply, redis.RedisError):
                raise reply

    def drop_each(self, boots: list[str], seconds: float) -> None:
        """Drop the records of each of ``boots``, taking each off the list once dropped; a failure is
        logged, and the rest is left for the next call."""
        with logs.redis_fault_let_go(logger, "cannot drop the old lease of %s", self.node):
            while boots:
                self.drop(boots[0], seconds)
                boots.pop(0)

    def _call(self, commands: list[tuple[Any, ...]], seconds: float) -> list[Any]:
        ledger = client()  # per URL: a URL changed (by a test's settings) gets a line of its own
        if self._line is None or self._line.client is not ledger:
            self._line = Line(ledger, HEARTBEAT_CLIENT_NAME)
        return self._line.execute(commands, seconds)


def ledger_address() -> str:
    """Where the ledger is, for a log line; never a credential."""
    try:
        return address(settings.redis_url())
    except ImproperlyConfigured:
        return "an unusable URL"
