"""The in-flight ledger: what each recoverable task was sent as, and which worker boot runs it.

An entry (``entry.py``) is written by the worker's main process just before a task is handed to the pool,
and removed when the message is acknowledged or rejected. The same Lua call that writes it checks the
task's fence, so a copy of a task that was already recovered (or marked terminal) never runs; the
scripts are in ``scripts/``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis

from celery_orphans import scripts
from celery_orphans.conf import settings
from celery_orphans.entry import Entry, Unreadable, parse
from celery_orphans.replies import NO_FENCE, fence_of
from celery_orphans.replies import Admission as Admission
from celery_orphans.replies import Fence as Fence
from celery_orphans.replies import Lift as Lift
from celery_orphans.replies import admission as admission
from celery_orphans.seal import signer
from celery_orphans.store import Keys, client

if TYPE_CHECKING:
    from redis.connection import AbstractConnection

# Ids per load call: bounds how long one call holds Redis (a few ms); the calls share one pipeline.
LOAD_CHUNK = 1000


@dataclass(frozen=True)
class Terms:
    """What admitting a delivery checks besides the task's fence (``Ledger.admit_delivery``)."""

    # The key of the lease of the boot that writes the entry: while that lease exists, the execution is alive.
    lease: str = ""
    # 0: a redelivery of a lost execution is admitted as any copy is. Otherwise it raises the fence's count
    # (kept ``ttl`` seconds) unless the count had reached ``cap``, which the answer says instead.
    cap: int = 0
    ttl: int = 0
    # A delivery of the same copy as an entry whose boot is alive is refused as a duplicate.
    single_flight: bool = False


class Ledger:
    """Ledger operations against one Redis client and key prefix."""

    def __init__(self, client: redis.Redis[bytes], keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._admit = client.register_script(scripts.ADMIT)
        self._release = client.register_script(scripts.RELEASE)
        self._claim = client.register_script(scripts.CLAIM)
        self._load = client.register_script(scripts.LOAD)
        self._release_many = client.register_script(scripts.RELEASE_MANY)
        self._unclaim = client.register_script(scripts.UNCLAIM)
        self._hand_back = client.register_script(scripts.HAND_BACK)
        self._stale = client.register_script(scripts.STALE)
        self._lift = client.register_script(scripts.LIFT)

    def admit_delivery(
        self, entry: Entry, releases: Sequence[tuple[str, str]] = (), terms: Terms = Terms()
    ) -> Admission:
        """Record ``entry`` unless its delivery is a stale copy or ``terms`` refuse it, and say what the
        call found. ``releases`` (``(task_id, token)`` pairs) are removed as ``release`` would, first, in
        the same call."""
        keys, args = self._admit_call(entry, releases, terms)
        return admission(entry.task_id, self._admit(keys=keys, args=args))

    def admit_command(
        self, entry: Entry, releases: Sequence[tuple[str, str]], terms: Terms
    ) -> tuple[Any, ...]:
        """``admit_delivery`` as one ``EVALSHA`` command, for a connection of the caller's own; its reply
        is read by ``admission(entry.task_id, reply)``. Redis answers ``NoScriptError`` if it lost the
        script: the same command with ``EVAL`` and ``scripts.ADMIT`` in place of the first two loads it."""
        keys, args = self._admit_call(entry, releases, terms)
        return (b"EVALSHA", scripts.ADMIT_SHA, len(keys), *keys, *args)

    def send_admit(
        self, conn: AbstractConnection, entry: Entry, releases: Sequence[tuple[str, str]], lease: str
    ) -> None:
        """``admit_delivery`` with no cap and no duplicate check, sent on ``conn`` without waiting for the
        answer, which ``admission(entry.task_id, conn.read_response())`` reads later, in the order sent.
        The script must be loaded (``load_scripts``); Redis answers ``NoScriptError`` if it was not."""
        keys, args = self._admit_call(entry, releases, Terms(lease=lease))
        # bytes: redis-py re-encodes and splits a str command name on every call.
        conn.send_command(b"EVALSHA", scripts.ADMIT_SHA, len(keys), *keys, *args)

    def load_scripts(self) -> None:
        """Load the admit script into Redis, for ``send_admit``."""
        self.client.execute_command("SCRIPT", "LOAD", scripts.ADMIT)

    def _admit_call(
        self, entry: Entry, releases: Sequence[tuple[str, str]], terms: Terms
    ) -> tuple[list[str], list[Any]]:
        d = entry.delivery
        keys = [
            self.keys.fence(entry.task_id),
            self.keys.entry(entry.task_id),
            self.keys.inflight,
            self.keys.checkpoint(entry.task_id),
            *(self.keys.entry(task_id) for task_id, _ in releases),
        ]
        args = [
            entry.task_id,
            d.retries,
            d.attempt,
            entry.token,
            entry.sealed(),
            entry.recorded_at,
            terms.cap,
            terms.ttl,
            terms.lease,
            1 if terms.single_flight else 0,
            self.keys.boots(entry.node),
            entry.boot,
            *(value for task_id, token in releases for value in (token, task_id)),
        ]
        return keys, args

    def stale(self, entry: Entry) -> bool:
        """Whether the task's fence has moved past ``entry``'s copy (as ``admit_delivery`` would find),
        reading only."""
        d = entry.delivery
        return bool(self._stale(keys=[self.keys.fence(entry.task_id)], args=[d.retries, d.attempt]))

    def stale_command(self, entry: Entry) -> tuple[Any, ...]:
        """``stale`` as one ``EVAL`` command, for a connection of the caller's own; its reply is truthy
        when the fence has moved past the copy."""
        d = entry.delivery
        return (b"EVAL", scripts.STALE, 1, self.keys.fence(entry.task_id), d.retries, d.attempt)

    def hand_back(self, task_id: str, token: str) -> bool:
        """Mark the entry written with ``token`` as handed back to the broker, and make ``token`` void (see
        ``HAND_BACK``)."""
        keys, args = self._hand_back_call(task_id, token)
        return bool(self._hand_back(keys=keys, args=args))

    def hand_back_command(self, task_id: str, token: str) -> tuple[Any, ...]:
        """``hand_back`` as one ``EVAL`` command, for a connection of the caller's own."""
        keys, args = self._hand_back_call(task_id, token)
        return (b"EVAL", scripts.HAND_BACK, len(keys), *keys, *args)

    def _hand_back_call(self, task_id: str, token: str) -> tuple[list[str], list[Any]]:
        keys = [self.keys.entry(task_id), self.keys.fence(task_id)]
        return keys, [token, time.time(), settings.ATTEMPTS_WINDOW_SECONDS]

    def release(self, task_id: str, token: str) -> bool:
        """Remove the entry if it is still the one written with ``token``."""
        return bool(self._release(keys=[self.keys.entry(task_id), self.keys.inflight], args=[token, task_id]))

    def release_many(self, releases: list[tuple[str, str]]) -> int:
        """``release`` for each ``(task_id, token)``, in one call; returns how many entries went."""
        if not releases:
            return 0
        keys, args = self._release_many_call(releases)
        return int(self._release_many(keys=keys, args=args))

    def release_many_command(self, releases: list[tuple[str, str]]) -> tuple[Any, ...]:
        """``release_many`` as one ``EVAL`` command, for a connection of the caller's own; its reply is
        how many entries went."""
        keys, args = self._release_many_call(releases)
        return (b"EVAL", scripts.RELEASE_MANY, len(keys), *keys, *args)

    def _release_many_call(self, releases: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
        keys = [self.keys.entry(task_id) for task_id, _ in releases] + [self.keys.inflight]
        args = [value for task_id, token in releases for value in (token, task_id)]
        return keys, args

    def claim(
        self,
        task_id: str,
        *,
        token: str,
        attempts: int,
        retries: int,
        ttl: int,
        mode: scripts.ClaimMode,
        keep: bool = False,
    ) -> int | None:
        """Atomically take an orphan for ``mode`` if nothing moved.

        For ``recover`` returns the new attempt number (the fence now drops every older copy);
        otherwise the recovery count. ``None`` when another sweep or a worker got there first, and for
        ``recover`` when the entry's delivery was already sent again; for ``complete`` unless the latest
        recovery claimed this very entry. A ``terminal`` claim with ``keep`` (at the cap) keeps the entry
        for ``ttl`` seconds, out of every sweep's sight, for ``lift``.
        """
        result = self._claim(
            keys=[self.keys.fence(task_id), self.keys.entry(task_id), self.keys.inflight],
            args=[
                token,
                attempts,
                retries,
                ttl,
                mode.value,
                task_id,
                scripts.CLAIM_SECONDS,
                1 if keep else 0,
            ],
        )
        return None if int(result) < 0 else int(result)

    def lift(self, task_id: str) -> Lift:
        """Lift the cap of a task marked terminal at it: the next sweep recovers it once more (``LIFT``)."""
        done, attempts = self._lift(
            keys=[self.keys.fence(task_id), self.keys.entry(task_id), self.keys.inflight], args=[task_id]
        )
        return Lift(int(done), int(attempts))

    def mark_sent(self, task_id: str, token: str) -> None:
        """Record that the delivery of the entry written with ``token`` was sent again."""
        self.client.hset(self.keys.fence(task_id), "sent", token)

    def unclaim(self, task_id: str, token: str) -> bool:
        """Lift the hold a claim put on the entry written with ``token``; the count stays raised."""
        return bool(self._unclaim(keys=[self.keys.entry(task_id)], args=[token]))

    def older_than(self, cutoff: float) -> list[str]:
        ids = self.client.zrangebyscore(self.keys.inflight, "-inf", cutoff)
        return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]

    def load(self, task_ids: list[str]) -> dict[str, Entry | Unreadable | None]:
        """Entries by id: an ``Entry``, ``Unreadable`` for one that cannot be trusted, ``None`` if absent."""
        return self.load_with_fences(task_ids)[0]

    def load_with_fences(
        self, task_ids: list[str]
    ) -> tuple[dict[str, Entry | Unreadable | None], dict[str, Fence]]:
        """Entries by id (as ``load``) and what the latest recovery of each task did, in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for start in range(0, len(task_ids), LOAD_CHUNK):
            keys: list[str] = []
            for task_id in task_ids[start : start + LOAD_CHUNK]:
                keys += [self.keys.entry(task_id), self.keys.fence(task_id)]
            self._load(keys=keys, client=pipe)
        replies = [reply for chunk in pipe.execute() for reply in chunk] if task_ids else []
        found: dict[str, Entry | Unreadable | None] = {}
        fences: dict[str, Fence] = {}
        opener = signer()  # the settings read once for the whole read, not once per entry
        for task_id, reply in zip(task_ids, replies, strict=True):
            if reply is None:  # no entry's text, no fence
                found[task_id], fences[task_id] = None, NO_FENCE
                continue
            token, raw, handed_back, attempts, claimed, sent, lifted = reply
            found[task_id] = parse(task_id, token, raw, handed_back, opener)
            fences[task_id] = fence_of(attempts, claimed, sent, lifted)
        return found, fences

    def attempts(self, task_ids: list[str]) -> dict[str, int]:
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.hget(self.keys.fence(task_id), "attempts")
        return {
            task_id: int(value) if value is not None else 0
            for task_id, value in zip(task_ids, pipe.execute())
        }

    def count(self) -> int:
        return int(self.client.zcard(self.keys.inflight))


def ledger_for(keys: Keys | None = None) -> Ledger:
    """The ledger under ``keys`` (the configured prefix by default) on the configured Redis."""
    return _ledger(client(), keys or Keys.current())


@functools.lru_cache(maxsize=16)
def _ledger(conn: redis.Redis[bytes], keys: Keys) -> Ledger:
    # One per client and prefix: building a Ledger hashes its Lua scripts, once per task otherwise.
    return Ledger(conn, keys)
