"""The in-flight ledger: what each recoverable task was sent as, and which worker boot runs it.

An entry is written by the worker's main process just before a task is handed to the pool, and removed
when the message is acknowledged or rejected. The same Lua call that writes it checks the task's fence,
so a copy of a task that was already recovered (or marked terminal) never runs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import redis
from kombu.utils.json import JSONEncoder, object_hook

from celery_orphans.reconcile import SAFE_CONTENT_TYPES
from celery_orphans.store import Keys

if TYPE_CHECKING:
    from redis.connection import AbstractConnection

HEADER = "celery_orphans"
ENTRY_VERSION = 1

# KEYS[1..4]: the task's fence, entry, the in-flight index, its checkpoint. ARGV[1..8]: task id, retries,
# recovery attempt, token, entry JSON, time, the task's recovery cap (0: count no redelivery) and the
# fence's TTL. Then, carried along so an acknowledgement costs the worker no round trip of its own:
# KEYS[5..] entries to remove, ARGV[9..] their token and task id in pairs. Those go first, so an entry
# being replaced by a new copy of the same task is removed before it is.
# An entry of the same copy (retries and attempt) still there, written by another execution, is an
# orphan the broker has delivered again (RabbitMQ does at once when a worker dies): the delivery counts
# as a recovery, up to the cap. A copy a recovery sent carries a higher attempt than the entry it
# replaces, and is not counted again. The fence's 'copy' is the attempt the current copy carries, which
# such a count leaves as it was; the fence drops copies older than it.
# Returns {0 stale / 1 admitted / 2 admitted with a checkpoint, recoveries, 1 counted / 2 at the cap},
# and for a redelivery, the entry it replaced: the record names the worker that lost the task.
_ADMIT = """
for i = 5, #KEYS do
  local j = 9 + 2 * (i - 5)
  if redis.call('HGET', KEYS[i], 'token') == ARGV[j] then
    redis.call('DEL', KEYS[i])
    redis.call('ZREM', KEYS[3], ARGV[j + 1])
  end
end
local f = redis.call('HMGET', KEYS[1], 'attempts', 'retries', 'terminal', 'copy')
local attempts = tonumber(f[1]) or 0
local retries = tonumber(f[2]) or -1
local msg_retries = tonumber(ARGV[2])
local msg_attempt = tonumber(ARGV[3])
local current = tonumber(f[4]) or attempts
if f[3] == '1' and msg_retries <= retries then return {0, attempts, 0} end
if msg_retries < retries or (msg_retries == retries and msg_attempt < current) then
  return {0, attempts, 0}
end
local copy = ARGV[2] .. ':' .. ARGV[3]
local redelivered, lost = 0, false
if tonumber(ARGV[7]) > 0 then
  local old = redis.call('HMGET', KEYS[2], 'token', 'copy', 'entry')
  if old[1] and old[2] == copy then
    lost = old[3]
    if attempts >= tonumber(ARGV[7]) then
      redelivered = 2
    else
      attempts = attempts + 1
      redelivered = 1
      redis.call('HSET', KEYS[1], 'attempts', attempts, 'retries', ARGV[2], 'copy', ARGV[3])
      redis.call('EXPIRE', KEYS[1], ARGV[8])
    end
  end
end
redis.call('HSET', KEYS[2], 'token', ARGV[4], 'entry', ARGV[5], 'copy', copy)
redis.call('ZADD', KEYS[3], ARGV[6], ARGV[1])
return {1 + redis.call('EXISTS', KEYS[4]), attempts, redelivered, lost}
"""

_ADMIT_SHA = hashlib.sha1(_ADMIT.encode()).hexdigest()  # what Redis names it by

_RELEASE = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[2])
  return 1
end
return 0
"""

# KEYS: the entry of each task, then the in-flight index. ARGV: token and task id of each, in pairs.
_RELEASE_MANY = """
local released = 0
for i = 1, #ARGV, 2 do
  local key = KEYS[(i + 1) / 2]
  if redis.call('HGET', key, 'token') == ARGV[i] then
    redis.call('DEL', key)
    redis.call('ZREM', KEYS[#KEYS], ARGV[i + 1])
    released = released + 1
  end
end
return released
"""

# KEYS: entry and fence of each task, in pairs. Returns token and entry, then the fence's recovery count
# and the tokens its latest recovery claimed and sent, of each task, flat: one call instead of two
# commands per task, which is most of a sweep's reading at ten thousand tasks.
_LOAD = """
local out = {}
for i = 1, #KEYS, 2 do
  local e = redis.call('HMGET', KEYS[i], 'token', 'entry')
  local f = redis.call('HMGET', KEYS[i + 1], 'attempts', 'claimed', 'sent')
  out[#out + 1] = e[1]
  out[#out + 1] = e[2]
  out[#out + 1] = f[1]
  out[#out + 1] = f[2]
  out[#out + 1] = f[3]
end
return out
"""
# Ids per _LOAD call: bounds how long one call holds Redis (a few ms), the calls share one pipeline.
LOAD_CHUNK = 1000

# Claims an orphan for one action, only if nothing moved since the sweep looked: the entry still
# carries the observed token (or is still absent), no other sweep holds it, and the recovery count is
# unchanged. A recovery records in the fence which entry it claimed ('claimed') and that the copy it sends
# carries the new count ('copy', see _ADMIT), and once its message is
# out, which entry it sent ('sent'): an entry left behind after that is never sent again, only its
# bookkeeping is finished ('complete'). Both leave the entry in place until the claimer commits
# (actions.py), so they also hold it ('held', 'held_until' on the entry): a sweep that looks before that
# commit, or between the commit and the release, reads the same token and count and must not act on the
# task a second time. The hold lapses after ARGV[7] seconds, so a claimer that died is followed by the
# next sweep.
_CLAIM = """
local token = redis.call('HGET', KEYS[2], 'token')
if ARGV[1] == '' then
  if token then return -1 end
elseif token ~= ARGV[1] then
  return -1
end
local now = tonumber(redis.call('TIME')[1])
if token then
  local hold = redis.call('HMGET', KEYS[2], 'held', 'held_until')
  if hold[1] == token and (tonumber(hold[2]) or 0) > now then return -1 end
end
local attempts = tonumber(redis.call('HGET', KEYS[1], 'attempts')) or 0
if attempts ~= tonumber(ARGV[2]) then return -1 end
local mode = ARGV[5]
if mode == 'complete' then
  if redis.call('HGET', KEYS[1], 'claimed') ~= ARGV[1] then return -1 end
  redis.call('HSET', KEYS[2], 'held', token, 'held_until', now + tonumber(ARGV[7]))
  return attempts
end
if mode == 'recover' then
  if redis.call('HGET', KEYS[1], 'sent') == ARGV[1] then return -1 end
  attempts = attempts + 1
  redis.call('HSET', KEYS[1], 'attempts', attempts, 'retries', ARGV[3], 'claimed', ARGV[1], 'copy', attempts)
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  if token then
    redis.call('HSET', KEYS[2], 'held', token, 'held_until', now + tonumber(ARGV[7]))
  end
  return attempts
end
if mode == 'terminal' then
  redis.call('HSET', KEYS[1], 'attempts', attempts, 'retries', ARGV[3], 'terminal', '1')
  redis.call('EXPIRE', KEYS[1], ARGV[4])
end
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[6])
return attempts
"""


# Lifts the hold of a claim whose sweep did not commit, so the next sweep need not wait for it to lapse.
_UNCLAIM = """
if redis.call('HGET', KEYS[1], 'held') == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'held', 'held_until')
  return 1
end
return 0
"""

# How long a claim holds other sweeps off an entry: longer than a sweep takes from its claim to
# its commit, as long as the Redis sweep lock lives (locks.REDIS_LOCK_SECONDS).
CLAIM_SECONDS = 300


@dataclass(frozen=True)
class Delivery:
    """One message exactly as the broker delivered it, enough to publish it again unchanged."""

    body: str
    body_encoding: str  # "utf-8" when the raw body was text, else "base64"
    content_type: str
    content_encoding: str
    headers: dict[str, Any]
    properties: dict[str, Any]
    exchange: str
    routing_key: str
    delivery_tag: str | None

    def raw_body(self) -> bytes | str:
        return base64.b64decode(self.body) if self.body_encoding == "base64" else self.body

    @property
    def retries(self) -> int:
        value = self.headers.get("retries") or 0
        return value if isinstance(value, int) else 0

    @property
    def attempt(self) -> int:
        return recovery_attempt(self.headers)


@dataclass(frozen=True)
class Entry:
    """A ledger entry: who runs the task (node and boot) and the delivery it runs."""

    task_id: str
    task_name: str
    node: str
    boot: str
    recorded_at: float
    delivery: Delivery
    token: str = ""
    version: int = field(default=ENTRY_VERSION)

    def to_json(self) -> str:
        # vars() rather than asdict(): asdict deep-copies the headers, and this runs before every task.
        data = {**vars(self), "delivery": vars(self.delivery)}
        del data["token"]
        return _ENCODER.encode(data)

    @classmethod
    def from_json(cls, raw: str | bytes, token: str) -> Entry:
        """Parse a stored entry; ``ValueError`` says why one cannot be trusted to be sent again as is."""
        data = _DECODER.decode(raw.decode() if isinstance(raw, bytes) else raw)
        if not isinstance(data, dict) or data.get("version") != ENTRY_VERSION:
            raise ValueError("not a celery-orphans ledger entry of a known version")
        _expect_keys("ledger entry", data, _ENTRY_KEYS)
        for name in ("task_id", "task_name", "node", "boot"):
            _expect_text(name, data[name])
        recorded_at = data["recorded_at"]
        if isinstance(recorded_at, bool) or not isinstance(recorded_at, (int, float)):
            raise ValueError(f"recorded_at is {type(recorded_at).__name__}, not a timestamp")
        _timestamp(recorded_at)
        delivery = _delivery(data["delivery"])
        # The message is sent again as stored: it must run the task the entry names, under its id, or a
        # forged entry naming a recoverable task could run any other.
        if delivery.headers.get("task") != data["task_name"] or delivery.headers.get("id") != data["task_id"]:
            raise ValueError("its message would run another task or id than the entry names")
        return cls(
            task_id=data["task_id"],
            task_name=data["task_name"],
            node=data["node"],
            boot=data["boot"],
            recorded_at=float(recorded_at),
            delivery=delivery,
            token=token,
        )


# kombu's types in the headers (a datetime, say) come back as they went in, so the message is sent again
# unchanged; one decoder for every entry, where kombu's loads() builds one per call.
_DECODER = json.JSONDecoder(object_hook=object_hook)
# kombu's, as its dumps() would build for every call. A decoded message cannot hold a cycle: no need to
# look for one on the path of every task.
_ENCODER = JSONEncoder(check_circular=False)
_ENTRY_KEYS = frozenset({"task_id", "task_name", "node", "boot", "recorded_at", "delivery", "version"})
_DELIVERY_KEYS = frozenset(f.name for f in fields(Delivery))
# The properties delivery_from_message keeps, and the types the broker accepts for them.
_PROPERTY_TYPES: dict[str, type] = {
    "correlation_id": str,
    "reply_to": str,
    "priority": int,
    "delivery_mode": int,
}


def _expect_keys(what: str, data: dict[str, Any], keys: frozenset[str]) -> None:
    missing, extra = keys - set(data), set(data) - keys
    if missing or extra:
        raise ValueError(f"{what} lacks {sorted(missing)} or has unknown {sorted(extra)}")


def _expect_text(name: str, value: object, *, empty: bool = False) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} is {type(value).__name__}, not text")
    if not value and not empty:
        raise ValueError(f"{name} is empty")


def _timestamp(value: float) -> datetime:
    try:
        if not math.isfinite(value):
            raise ValueError
        return datetime.fromtimestamp(value, tz=timezone.utc)
    except (ValueError, OverflowError, OSError):
        raise ValueError(f"recorded_at {value!r} is not a time") from None


def _delivery(data: object) -> Delivery:
    """A stored delivery whose every field has the type and value publishing it again relies on."""
    if not isinstance(data, dict):
        raise ValueError("ledger entry has no delivery")
    _expect_keys("delivery", data, _DELIVERY_KEYS)
    for name in ("body", "content_type", "content_encoding", "exchange", "routing_key"):
        _expect_text(name, data[name], empty=True)
    if not data["exchange"] and not data["routing_key"]:
        raise ValueError("the message names neither an exchange nor a queue")
    if data["delivery_tag"] is not None:
        _expect_text("delivery_tag", data["delivery_tag"])
    headers, properties = data["headers"], data["properties"]
    if not isinstance(headers, dict):
        raise ValueError(f"headers are {type(headers).__name__}, not an object")
    retries = headers.get("retries", 0)
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
        raise ValueError(f"the retries header {retries!r} is not a count")
    if not isinstance(properties, dict):
        raise ValueError(f"properties are {type(properties).__name__}, not an object")
    for name, value in properties.items():
        expected = _PROPERTY_TYPES.get(name)
        if expected is None or isinstance(value, bool) or not isinstance(value, expected):
            raise ValueError(f"message property {name!r} is unknown or of the wrong type")
    if properties.get("delivery_mode", 2) not in (1, 2):
        raise ValueError("message property 'delivery_mode' is neither 1 nor 2")
    delivery = Delivery(**data)
    _check_body(delivery)
    return delivery


def _check_body(delivery: Delivery) -> None:
    # Publishing encodes a text body with its content encoding: an encoding that fails here would
    # fail only after the recovery was claimed. A message of an unsafe type is never published.
    if delivery.body_encoding not in ("base64", "utf-8"):
        raise ValueError(f"unknown body encoding {delivery.body_encoding!r}")
    if delivery.content_type not in SAFE_CONTENT_TYPES:
        return
    if delivery.body_encoding == "base64":
        try:
            base64.b64decode(delivery.body, validate=True)
        except ValueError:
            raise ValueError("the base64 body is not base64") from None
    else:
        try:
            delivery.body.encode(delivery.content_encoding or "utf-8")
        except (LookupError, UnicodeError):
            raise ValueError(f"the body cannot be encoded as {delivery.content_encoding!r}") from None


def recovery_attempt(headers: dict[str, Any] | None) -> int:
    """The recovery attempt a message carries: 0 for one sent by its caller, n for the n-th recovery."""
    meta = (headers or {}).get(HEADER)
    attempt = meta.get("attempt") if isinstance(meta, dict) else None
    return attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else 0


def delivery_from_message(message: Any) -> Delivery:
    """Capture a kombu message; the body is kept as delivered, never decoded."""
    raw = message.body
    if isinstance(raw, str):
        body, encoding = raw, "utf-8"
    else:
        body, encoding = base64.b64encode(bytes(raw)).decode("ascii"), "base64"
    props = message.properties or {}
    info = message.delivery_info or {}
    tag = getattr(message, "delivery_tag", None)
    return Delivery(
        body=body,
        body_encoding=encoding,
        content_type=message.content_type or "",
        content_encoding=message.content_encoding or "",
        headers=dict(message.headers or {}),
        properties={
            k: props[k]
            for k in ("correlation_id", "reply_to", "priority", "delivery_mode")
            if props.get(k) is not None
        },
        exchange=info.get("exchange") or "",
        routing_key=info.get("routing_key") or "",
        delivery_tag=None if tag is None else str(tag),
    )


@dataclass(frozen=True)
class Admission:
    """What admitting a delivery found, in the one call that recorded it."""

    admitted: bool  # False: a stale copy, to drop
    checkpoint: bool = False  # the task has a checkpoint
    attempts: int = 0  # the fence's recovery count, this delivery's included
    redelivered: bool = False  # it re-delivers an orphan's copy, and was counted as a recovery
    limit_reached: bool = False  # it re-delivers an orphan's copy, but the count had reached the cap
    lost: Entry | str | None = None  # the entry of the execution that lost it, as ``Ledger.load`` reads it


@dataclass(frozen=True)
class Fence:
    """A task's fence: the recoveries made, and the token of the entry the latest one claimed and sent."""

    attempts: int = 0
    claimed: str | None = None
    sent: str | None = None

    def sent_again(self, entry: Entry) -> bool:
        return bool(entry.token) and self.sent == entry.token

    def claimed_by_latest(self, entry: Entry) -> bool:
        return bool(entry.token) and self.claimed == entry.token


class Ledger:
    """Ledger operations against one Redis client and key prefix."""

    def __init__(self, client: redis.Redis[bytes], keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._admit = client.register_script(_ADMIT)
        self._release = client.register_script(_RELEASE)
        self._claim = client.register_script(_CLAIM)
        self._load = client.register_script(_LOAD)
        self._release_many = client.register_script(_RELEASE_MANY)
        self._unclaim = client.register_script(_UNCLAIM)

    def admit(self, entry: Entry) -> bool:
        """Record ``entry`` unless its delivery is a stale copy; ``False`` means drop it."""
        return self.admit_delivery(entry).admitted

    def admit_delivery(
        self, entry: Entry, releases: Sequence[tuple[str, str]] = (), *, cap: int = 0, ttl: int = 0
    ) -> Admission:
        """``admit``, saying whether the task has a checkpoint, and counting a broker's redelivery.

        ``releases`` (``(task_id, token)`` pairs) are removed as ``release`` would, first, in the same call.

        With ``cap`` 0 a redelivery is admitted as any copy is; otherwise it raises the fence's count
        (kept ``ttl`` seconds) unless the count had reached ``cap``, which the answer says instead.
        """
        keys, args = self._admit_call(entry, releases, cap, ttl)
        return admission(entry.task_id, self._admit(keys=keys, args=args))

    def send_admit(self, conn: AbstractConnection, entry: Entry, releases: Sequence[tuple[str, str]]) -> None:
        """``admit_delivery`` with no cap, sent on ``conn`` without waiting for the answer, which
        ``admission(entry.task_id, conn.read_response())`` reads later, in the order sent. The script
        must be loaded (``load_scripts``); Redis answers ``NoScriptError`` if it was not."""
        keys, args = self._admit_call(entry, releases, 0, 0)
        # bytes: redis-py re-encodes and splits a str command name on every call.
        conn.send_command(b"EVALSHA", _ADMIT_SHA, len(keys), *keys, *args)

    def load_scripts(self) -> None:
        """Load the admit script into Redis, for ``send_admit``."""
        self.client.execute_command("SCRIPT", "LOAD", _ADMIT)

    def _admit_call(
        self, entry: Entry, releases: Sequence[tuple[str, str]], cap: int, ttl: int
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
            entry.to_json(),
            entry.recorded_at,
            cap,
            ttl,
            *(value for task_id, token in releases for value in (token, task_id)),
        ]
        return keys, args

    def release(self, task_id: str, token: str) -> bool:
        """Remove the entry if it is still the one written with ``token``."""
        return bool(self._release(keys=[self.keys.entry(task_id), self.keys.inflight], args=[token, task_id]))

    def release_many(self, releases: list[tuple[str, str]]) -> int:
        """``release`` for each ``(task_id, token)``, in one call; returns how many entries went."""
        if not releases:
            return 0
        keys = [self.keys.entry(task_id) for task_id, _ in releases] + [self.keys.inflight]
        args = [value for task_id, token in releases for value in (token, task_id)]
        return int(self._release_many(keys=keys, args=args))

    def claim(
        self, task_id: str, *, token: str, attempts: int, retries: int, ttl: int, mode: str
    ) -> int | None:
        """Atomically take an orphan for ``mode`` (recover, complete, terminal, forget) if nothing moved.

        For ``recover`` returns the new attempt number (the fence now drops every older copy);
        otherwise the recovery count. ``None`` when another sweep or a worker got there first, and for
        ``recover`` when the entry's delivery was already sent again; for ``complete`` unless the latest
        recovery claimed this very entry.
        """
        result = self._claim(
            keys=[self.keys.fence(task_id), self.keys.entry(task_id), self.keys.inflight],
            args=[token, attempts, retries, ttl, mode, task_id, CLAIM_SECONDS],
        )
        return None if int(result) < 0 else int(result)

    def mark_sent(self, task_id: str, token: str) -> None:
        """Record that the delivery of the entry written with ``token`` was sent again."""
        self.client.hset(self.keys.fence(task_id), "sent", token)

    def fences(self, task_ids: list[str]) -> dict[str, Fence]:
        """What the latest recovery of each task did: its count, and which entry it claimed and sent."""
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.hmget(self.keys.fence(task_id), "attempts", "claimed", "sent")
        return {task_id: _fence(*values) for task_id, values in zip(task_ids, pipe.execute())}

    def unclaim(self, task_id: str, token: str) -> bool:
        """Lift the hold a claim put on the entry written with ``token``; the count stays raised."""
        return bool(self._unclaim(keys=[self.keys.entry(task_id)], args=[token]))

    def older_than(self, cutoff: float) -> list[str]:
        ids = self.client.zrangebyscore(self.keys.inflight, "-inf", cutoff)
        return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]

    def load(self, task_ids: list[str]) -> dict[str, Entry | str | None]:
        """Entries by id: an ``Entry``, an error message for an unreadable one, or ``None`` if absent."""
        return self.load_with_fences(task_ids)[0]

    def load_with_fences(self, task_ids: list[str]) -> tuple[dict[str, Entry | str | None], dict[str, Fence]]:
        """Entries by id (as ``load``) and fences by id (as ``fences``), in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for start in range(0, len(task_ids), LOAD_CHUNK):
            keys: list[str] = []
            for task_id in task_ids[start : start + LOAD_CHUNK]:
                keys += [self.keys.entry(task_id), self.keys.fence(task_id)]
            self._load(keys=keys, client=pipe)
        flat = [value for chunk in pipe.execute() for value in chunk] if task_ids else []
        found: dict[str, Entry | str | None] = {}
        fences: dict[str, Fence] = {}
        for i, task_id in enumerate(task_ids):
            token, raw, attempts, claimed, sent = flat[5 * i : 5 * i + 5]
            found[task_id] = _parse(task_id, token, raw)
            fences[task_id] = _fence(attempts, claimed, sent)
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


def admission(task_id: str, reply: list[Any]) -> Admission:
    """What ``_ADMIT`` answered about the delivery of ``task_id``."""
    written, attempts, redelivered, *lost = reply
    return Admission(
        admitted=int(written) > 0,
        checkpoint=int(written) == 2,
        attempts=int(attempts),
        redelivered=int(redelivered) == 1,
        limit_reached=int(redelivered) == 2,
        lost=_parse(task_id, b"", lost[0] if lost else None),
    )


def _fence(attempts: bytes | None, claimed: bytes | None, sent: bytes | None) -> Fence:
    return Fence(
        attempts=int(attempts) if attempts is not None else 0,
        claimed=claimed.decode() if claimed else None,
        sent=sent.decode() if sent else None,
    )


def _parse(task_id: str, token: bytes | None, raw: bytes | None) -> Entry | str | None:
    if raw is None:
        return None
    try:
        entry = Entry.from_json(raw, (token or b"").decode())
    except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as exc:
        return f"unreadable ledger entry: {exc}"
    return entry if entry.task_id == task_id else "ledger entry names another task id"


def now() -> float:
    return time.time()
