"""A ledger entry: the delivery a worker boot runs, exactly as the broker delivered it, and who runs it.

An entry is sent again as stored, so reading one back checks every field that publishing relies on; an
entry that fails a check is ``Unreadable``, never sent. The worker that writes an entry seals it: the stored
text ends in an HMAC-SHA256 tag over the entry's exact JSON (``django.core.signing``, salted, keyed by
``CELERY_ORPHANS_SIGNING_KEY`` or Django's ``SECRET_KEY``, with their fallback keys for rotation). Write
access to the ledger's Redis is not enough to make the sweep publish anything: an entry whose tag does not
match is ``Unreadable``.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from typing import Any

from django.core import signing
from kombu.utils.json import JSONEncoder, object_hook

from celery_orphans.rules import SAFE_CONTENT_TYPES
from celery_orphans.seal import signer

HEADER = "celery_orphans"
ENTRY_VERSION = 1


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
    # Kept beside the JSON, not in it: when its worker handed the message back to the broker (Unix time).
    handed_back_at: float | None = None

    def to_json(self) -> str:
        # vars() rather than asdict(): asdict deep-copies the headers, and this runs before every task.
        data = {**vars(self), "delivery": vars(self.delivery)}
        del data["token"], data["handed_back_at"]
        return _ENCODER.encode(data)

    def sealed(self) -> str:
        """The entry as the ledger stores it: its JSON followed by its authentication tag."""
        return signer().sign(self.to_json())

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


FORGED = (
    "its authentication tag does not match: the entry was not written by a worker holding the signing key "
    "(forged or altered in Redis, or sealed with a key that is no longer configured); never sent again"
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
class Unreadable:
    """A stored entry that cannot be trusted to be sent again, and why."""

    reason: str


def parse(
    task_id: str,
    token: bytes | None,
    raw: bytes | None,
    handed_back: bytes | None = None,
    opener: signing.Signer | None = None,
) -> Entry | Unreadable | None:
    """The entry stored for ``task_id`` (``None`` when there is none), its tag checked by ``opener``
    (``signer()`` when not given: pass one to read many entries)."""
    if raw is None:
        return None
    try:
        stored = (opener or signer()).unsign(raw.decode() if isinstance(raw, bytes) else raw)
    except (signing.BadSignature, UnicodeDecodeError):
        return Unreadable(FORGED)
    try:
        entry = Entry.from_json(stored, (token or b"").decode())
        if handed_back is not None:
            entry = dataclasses.replace(entry, handed_back_at=float(handed_back))
    except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as exc:
        return Unreadable(f"unreadable ledger entry: {exc}")
    return entry if entry.task_id == task_id else Unreadable("ledger entry names another task id")
