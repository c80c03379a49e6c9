"""The in-flight ledger: what each recoverable task was sent as, and which worker boot runs it.

An entry is written by the worker's main process just before a task is handed to the pool, and removed
when the message is acknowledged or rejected. The same Lua call that writes it checks the task's fence,
so a copy of a task that was already recovered (or marked terminal) never runs.
"""

from __future__ import annotations

import base64
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from kombu.utils.json import dumps, loads

from celery_orphans.store import Keys

HEADER = "celery_orphans"
ENTRY_VERSION = 1

_ADMIT = """
local f = redis.call('HMGET', KEYS[1], 'attempts', 'retries', 'terminal')
local attempts = tonumber(f[1]) or 0
local retries = tonumber(f[2]) or -1
local msg_retries = tonumber(ARGV[2])
local msg_attempt = tonumber(ARGV[3])
if f[3] == '1' and msg_retries <= retries then return 0 end
if msg_retries < retries or (msg_retries == retries and msg_attempt < attempts) then return 0 end
redis.call('HSET', KEYS[2], 'token', ARGV[4], 'entry', ARGV[5])
redis.call('ZADD', KEYS[3], ARGV[6], ARGV[1])
return 1
"""

_RELEASE = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[2])
  return 1
end
return 0
"""

# Claims an orphan for one action, only if nothing moved since the sweep looked: the entry still
# carries the observed token (or is still absent), no other sweep holds a claim on it, and the recovery
# count is unchanged. A recover claim leaves the entry in place until the claimer commits (actions.py),
# so it marks the entry claimed: a sweep that looks before that commit (or between the commit and the
# release) reads the same token and count, and must not send the task a second time. The mark lapses
# after ARGV[7] seconds, so a claimer that died is followed by the next sweep.
_CLAIM = """
local token = redis.call('HGET', KEYS[2], 'token')
if ARGV[1] == '' then
  if token then return -1 end
elseif token ~= ARGV[1] then
  return -1
end
local now = tonumber(redis.call('TIME')[1])
if token then
  local claim = redis.call('HMGET', KEYS[2], 'claimed', 'claimed_until')
  if claim[1] == token and (tonumber(claim[2]) or 0) > now then return -1 end
end
local attempts = tonumber(redis.call('HGET', KEYS[1], 'attempts')) or 0
if attempts ~= tonumber(ARGV[2]) then return -1 end
local mode = ARGV[5]
if mode == 'recover' then
  attempts = attempts + 1
  redis.call('HSET', KEYS[1], 'attempts', attempts, 'retries', ARGV[3])
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  if token then
    redis.call('HSET', KEYS[2], 'claimed', token, 'claimed_until', now + tonumber(ARGV[7]))
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


# Lifts a recover claim that sent nothing, so the next sweep need not wait for it to lapse.
_UNCLAIM = """
if redis.call('HGET', KEYS[1], 'claimed') == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'claimed', 'claimed_until')
  return 1
end
return 0
"""

# How long a recover claim keeps other sweeps off an entry: longer than a sweep takes from its claim to
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
        data = asdict(self)
        data.pop("token")
        return str(dumps(data))

    @classmethod
    def from_json(cls, raw: str | bytes, token: str) -> Entry:
        data = loads(raw)
        if not isinstance(data, dict) or data.get("version") != ENTRY_VERSION:
            raise ValueError("not a celery-orphans ledger entry of a known version")
        delivery = data.pop("delivery")
        if not isinstance(delivery, dict):
            raise ValueError("ledger entry has no delivery")
        return cls(delivery=Delivery(**delivery), token=token, **data)


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


class Ledger:
    """Ledger operations against one Redis client and key prefix."""

    def __init__(self, client: redis.Redis[bytes], keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._admit = client.register_script(_ADMIT)
        self._release = client.register_script(_RELEASE)
        self._claim = client.register_script(_CLAIM)
        self._unclaim = client.register_script(_UNCLAIM)

    def admit(self, entry: Entry) -> bool:
        """Record ``entry`` unless its delivery is a stale copy; ``False`` means drop it."""
        d = entry.delivery
        written = self._admit(
            keys=[self.keys.fence(entry.task_id), self.keys.entry(entry.task_id), self.keys.inflight],
            args=[entry.task_id, d.retries, d.attempt, entry.token, entry.to_json(), entry.recorded_at],
        )
        return bool(written)

    def release(self, task_id: str, token: str) -> bool:
        """Remove the entry if it is still the one written with ``token``."""
        return bool(self._release(keys=[self.keys.entry(task_id), self.keys.inflight], args=[token, task_id]))

    def claim(
        self, task_id: str, *, token: str, attempts: int, retries: int, ttl: int, mode: str
    ) -> int | None:
        """Atomically take an orphan for ``mode`` (recover, terminal, forget) if nothing moved.

        For ``recover`` returns the new attempt number (the fence now drops every older copy);
        otherwise the recovery count. ``None`` when another sweep or a worker got there first.
        """
        result = self._claim(
            keys=[self.keys.fence(task_id), self.keys.entry(task_id), self.keys.inflight],
            args=[token, attempts, retries, ttl, mode, task_id, CLAIM_SECONDS],
        )
        return None if int(result) < 0 else int(result)

    def unclaim(self, task_id: str, token: str) -> bool:
        """Lift the recover claim made on the entry written with ``token``; the count stays raised."""
        return bool(self._unclaim(keys=[self.keys.entry(task_id)], args=[token]))

    def older_than(self, cutoff: float) -> list[str]:
        ids = self.client.zrangebyscore(self.keys.inflight, "-inf", cutoff)
        return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]

    def load(self, task_ids: list[str]) -> dict[str, Entry | str | None]:
        """Entries by id: an ``Entry``, an error message for an unreadable one, or ``None`` if absent."""
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.hmget(self.keys.entry(task_id), "token", "entry")
        found: dict[str, Entry | str | None] = {}
        for task_id, (token, raw) in zip(task_ids, pipe.execute()):
            if raw is None:
                found[task_id] = None
                continue
            try:
                entry = Entry.from_json(raw, (token or b"").decode())
            except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as exc:
                found[task_id] = f"unreadable ledger entry: {exc}"
                continue
            found[task_id] = entry if entry.task_id == task_id else "ledger entry names another task id"
        return found

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


def now() -> float:
    return time.time()
