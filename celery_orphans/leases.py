"""Worker leases, as the sweep and a booting worker read them.

Each worker boot proves it is alive by renewing one Redis key (``worker/heartbeat.py``). The key holds
the node name and an id unique to this boot of the process, and expires on its own (Redis enforces it,
so no clocks are compared). Each node also keeps a hash of its boots, with when each last renewed and
until when that renewal holds, in Redis's time, which outlives the leases.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterable

import redis

from celery_orphans.store import Keys, client

logger = logging.getLogger(__name__)


def fresh_boots(
    nodes: Iterable[str], conn: redis.Redis[bytes] | None = None, *, prune: bool = True
) -> dict[str, frozenset[str]]:
    """For each node name, the boot ids that may still be alive (two round trips in all).

    A boot is alive while its lease exists, and also while its last renewal still holds by the node's
    record although the lease is gone: a lease deleted, evicted or lost in a failover says nothing of
    its worker, which gives its executions up at its next beat, when it finds the lease gone.

    With ``prune``, boots that are neither are dropped from their node's set, so the sets of names that
    never come back do not grow with every crash. A live boot wrongly dropped adds itself at its next beat.
    """
    conn = conn or client()
    keys = Keys.current()
    nodes = sorted(set(nodes))
    pipe = conn.pipeline(transaction=False)
    pipe.time()
    for node in nodes:
        pipe.hgetall(keys.boots(node))
    (seconds, micros), *found = pipe.execute()
    now_ms = seconds * 1000 + micros // 1000
    records = {
        node: {_text(b): _renewal(v) for b, v in members.items()} for node, members in zip(nodes, found)
    }
    pairs = [(node, boot) for node in nodes for boot in sorted(records[node])]
    pipe = conn.pipeline(transaction=False)
    for node, boot in pairs:
        pipe.exists(keys.lease(node, boot))
    leased = {pair for pair, exists in zip(pairs, pipe.execute() if pairs else []) if exists}
    alive = {pair for pair in pairs if pair in leased or records[pair[0]][pair[1]][1] > now_ms}
    lapsed = [pair for pair in pairs if pair not in alive]
    if prune and lapsed:
        pipe = conn.pipeline(transaction=False)
        for node, boot in lapsed:
            pipe.hdel(keys.boots(node), boot)
        pipe.execute()
    return {node: frozenset(b for b in records[node] if (node, b) in alive) for node in nodes}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _renewal(value: bytes | str | None) -> tuple[float, float]:
    """A boot's record, ``renewed_ms:until_ms`` in Redis's time, as milliseconds; zeros if unreadable."""
    try:
        renewed, until = _text(value or b"").split(":")
        return float(renewed), float(until)
    except ValueError:
        return 0.0, 0.0


def last_beats(
    pairs: Iterable[tuple[str, str]], conn: redis.Redis[bytes] | None = None
) -> dict[tuple[str, str], float]:
    """When each (node, boot) last renewed its lease, in seconds since the epoch by Redis's clock, for
    the boots still listed under their node."""
    conn = conn or client()
    keys = Keys.current()
    pairs = list(pairs)
    pipe = conn.pipeline(transaction=False)
    for node, boot in pairs:
        pipe.hget(keys.boots(node), boot)
    found = {}
    for pair, value in zip(pairs, pipe.execute() if pairs else []):
        renewed_ms, _ = _renewal(value)
        if renewed_ms:
            found[pair] = renewed_ms / 1000
    return found


def count() -> int:
    """How many worker boots hold a live lease now (a SCAN: for status pages, not hot paths)."""
    return sum(1 for _ in client().scan_iter(match=f"{Keys.current().prefix}:lease:*", count=500))


def renewals(
    node: str, boots: Iterable[str], conn: redis.Redis[bytes] | None = None
) -> dict[str, bytes | None]:
    """The current lease value of each boot (it changes on every renewal); ``None`` once lapsed."""
    conn = conn or client()
    keys = Keys.current()
    boots = sorted(boots)
    values = conn.mget([keys.lease(node, boot) for boot in boots]) if boots else []
    return dict(zip(boots, values))


def renewed_within(node: str, boots: Iterable[str], seconds: float) -> frozenset[str]:
    """The boots whose lease is renewed within ``seconds``: proof that their process is alive.

    A boot whose lease neither lapses nor changes stays out; a lease is renewed every heartbeat, so
    watching for two heartbeats tells a live process from one that was killed a moment ago.
    """
    first = renewals(node, boots)
    watching = {boot for boot, value in first.items() if value is not None and not _provably_gone(value)}
    deadline = time.monotonic() + seconds
    renewed: set[str] = set()
    while watching and time.monotonic() < deadline:
        time.sleep(min(0.1, seconds))
        for boot, value in renewals(node, watching).items():
            if value is None:
                watching.discard(boot)
            elif value != first[boot]:
                renewed.add(boot)
                watching.discard(boot)
    return frozenset(renewed)


def _provably_gone(value: bytes) -> bool:
    """A lease written on this host by a process id that no longer exists is a dead boot's."""
    try:
        lease = json.loads(value)
        host, pid = lease["host"], int(lease["pid"])
    except (ValueError, KeyError, TypeError):
        return False
    if host != socket.gethostname() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
