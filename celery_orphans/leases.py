"""Worker leases, as the sweep and a booting worker read them.

Each worker boot proves it is alive by renewing one Redis key (``worker/heartbeat.py``). The key holds
the node name and an id unique to this boot of the process, and expires on its own (Redis enforces it,
so no clocks are compared). Each node also keeps a hash of its boots, with when each last renewed and
until when that renewal holds, in Redis's time, which outlives the leases. The watch orders every boot
by that instant, and each machine's hash names the processes of the boots on it (``processes.py``):
every renewal reads both, so the workers themselves notice a lapsed lease or an exited process
(``sweep/watch.py``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import redis

from celery_orphans import logs, scripts
from celery_orphans.processes import Process, exited
from celery_orphans.store import Keys, client

logger = logs.get(__name__)


class Boots(NamedTuple):
    """A node's boots as its record in Redis has them: alive, gone (a record that lapsed), exited."""

    alive: frozenset[str]
    gone: frozenset[str]
    exited: frozenset[str]  # gone, and seen to exit by a process on its machine
    presence_lost: frozenset[str] = frozenset()  # gone: Redis dropped its process's presence connection


def fresh_boots(
    nodes: Iterable[str], conn: redis.Redis[bytes] | None = None, *, prune: bool = True
) -> dict[str, frozenset[str]]:
    """For each node name, the boot ids that may still be alive (of ``boot_states``)."""
    return {node: b.alive for node, b in boot_states(nodes, conn, prune=prune).items()}


def boot_states(
    nodes: Iterable[str], conn: redis.Redis[bytes] | None = None, *, prune: bool = True
) -> dict[str, Boots]:
    """For each node name, its boots that may still be alive and those known gone (two round trips).

    A boot is alive while its lease exists, and also while its last renewal still holds by the node's
    record although the lease is gone: a lease deleted, evicted or lost in a failover says nothing of
    its worker, which gives its executions up at its next beat, when it finds the lease gone. A boot
    with a record that is neither is gone; a boot without a record is neither alive nor known gone.

    With ``prune``, gone boots are dropped from their node's set and from the watch, so the sets of
    names that never come back do not grow with every crash. A live boot wrongly dropped adds itself at
    its next beat.
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
    alive = {pair for pair in pairs if pair in leased or records[pair[0]][pair[1]].until > now_ms}
    lapsed = [pair for pair in pairs if pair not in alive]
    if prune and lapsed:
        pipe = conn.pipeline(transaction=False)
        for node, boot in lapsed:
            pipe.hdel(keys.boots(node), boot)
            pipe.zrem(keys.watch, member(node, boot))
        pipe.execute()
    return {
        node: Boots(
            alive=frozenset(b for b in records[node] if (node, b) in alive),
            gone=frozenset(b for b in records[node] if (node, b) not in alive),
            exited=frozenset(b for b, r in records[node].items() if r.exited and (node, b) not in alive),
            presence_lost=frozenset(
                b for b, r in records[node].items() if r.presence_lost and (node, b) not in alive
            ),
        )
        for node in nodes
    }


def member(node: str, boot: str) -> str:
    """A boot's name in the watch and in its machine's hash (a boot id holds no space)."""
    return f"{boot} {node}"


def _pair(value: bytes | str) -> tuple[str, str]:
    boot, _, node = _text(value).partition(" ")
    return node, boot


@dataclass(frozen=True)
class Seen:
    """What a renewal saw: lapsed boots, the other boots of its machine with their processes, and the
    boots whose presence is missing with the seconds left before it may be judged (``presence.py``)."""

    lapsed: list[tuple[str, str]] = field(default_factory=list)
    neighbours: list[tuple[str, str, Process]] = field(default_factory=list)
    missing: list[tuple[str, str, float]] = field(default_factory=list)

    @classmethod
    def from_reply(cls, reply: list[Any], machine: str | None, own: tuple[str, str]) -> Seen:
        """From the renewal script's reply (``scripts.RENEW``) of the boot ``own``."""
        lapsed = [_pair(m) for m in reply[1]] if len(reply) > 1 else []
        flat = reply[2] if len(reply) > 2 else []
        neighbours = []
        for name, value in zip(flat[::2], flat[1::2]):
            process = Process.parse(machine, _text(value)) if machine else None
            if process is not None and _pair(name) != own:
                neighbours.append((*_pair(name), process))
        return cls([p for p in lapsed if p != own], neighbours)


def claim_lapsed(node: str, boot: str, conn: redis.Redis[bytes] | None = None) -> bool:
    """Take a lapsed boot off the watch; ``True`` for the one caller that did."""
    conn = conn or client()
    claim = conn.register_script(scripts.CLAIM_LAPSED)
    return bool(claim(keys=[Keys.current().watch], args=[member(node, boot)]))


def claim_presence_lost(node: str, boot: str, conn: redis.Redis[bytes] | None = None) -> bool:
    """Record that the presence of ``boot`` is lost (``scripts.PRESENCE_LOST``); ``True`` for the one
    caller that recorded it."""
    conn = conn or client()
    keys = Keys.current()
    record = conn.register_script(scripts.PRESENCE_LOST)
    return bool(
        record(
            keys=[keys.presence, keys.presence_ring, keys.watch, keys.lease(node, boot), keys.boots(node)],
            args=[member(node, boot), boot],
        )
    )


def record_exit(node: str, boot: str, process: Process, conn: redis.Redis[bytes] | None = None) -> bool:
    """Record that the process of ``boot`` exited; ``True`` for the one caller that recorded it."""
    conn = conn or client()
    keys = Keys.current()
    record = conn.register_script(scripts.EXITED)
    return bool(
        record(
            keys=[keys.machine(process.machine), keys.lease(node, boot), keys.boots(node), keys.watch],
            args=[member(node, boot), str(process), boot],
        )
    )


def drop(node: str, boot: str, machine: str | None, conn: redis.Redis[bytes] | None = None) -> None:
    """Remove every record of a boot that stops or gives up: a sweep need not wait for it to lapse."""
    pipe: Any = (conn or client()).pipeline(transaction=False)
    for command in drop_commands(Keys.current(), node, boot, machine):
        pipe.execute_command(*command)
    pipe.execute()


def drop_commands(keys: Keys, node: str, boot: str, machine: str | None) -> list[tuple[str, ...]]:
    """The commands of ``drop``."""
    commands = [
        ("DEL", keys.lease(node, boot)),
        ("HDEL", keys.boots(node), boot),
        ("ZREM", keys.watch, member(node, boot)),
        ("HDEL", keys.presence, member(node, boot)),
        ("ZREM", keys.presence_ring, member(node, boot)),
    ]
    if machine:
        commands.append(("HDEL", keys.machine(machine), member(node, boot)))
    return commands


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Renewal(NamedTuple):
    renewed: float  # ms, Redis's time
    until: float  # ms, Redis's time; 0 once its process exited or its presence was lost
    exited: bool
    presence_lost: bool = False


def _renewal(value: bytes | str | None) -> Renewal:
    """A boot's record, ``renewed_ms:until_ms`` (or ``renewed_ms:0:exited``, ``renewed_ms:0:presence``);
    zeros if unreadable."""
    renewed, _, rest = _text(value or b"").partition(":")
    until, _, mark = rest.partition(":")
    try:
        return Renewal(float(renewed), float(until), mark == "exited", mark == "presence")
    except ValueError:
        return Renewal(0.0, 0.0, False)


def last_heartbeats(
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
        renewed_ms = _renewal(value).renewed
        if renewed_ms:
            found[pair] = renewed_ms / 1000
    return found


def count(conn: redis.Redis[bytes] | None = None) -> int:
    """How many worker boots hold a live lease now: those whose last renewal still holds (one round trip)."""
    conn = conn or client()
    seconds, micros = conn.time()
    return int(conn.zcount(Keys.current().watch, f"({seconds * 1000 + micros // 1000}", "+inf"))


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


def record_exits(node: str, boots: Iterable[str], conn: redis.Redis[bytes] | None = None) -> None:
    """Record the exit of each of ``boots`` whose lease names a process of this machine that has exited
    (``record_exit``, as the watch does), so that its record says it is gone."""
    conn = conn or client()
    for boot, value in renewals(node, boots, conn).items():
        process = _process(value) if value is not None else None
        if process is not None and exited(process):
            record_exit(node, boot, process, conn)


def _provably_gone(value: bytes) -> bool:
    """A lease whose process, on this machine, has exited is a dead boot's."""
    process = _process(value)
    return process is not None and exited(process)


def _process(value: bytes) -> Process | None:
    """The process a lease names, if it can be told where."""
    try:
        lease = json.loads(value)
        return Process.parse(lease["machine"], lease["process"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
