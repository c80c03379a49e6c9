"""Ledger entries: a delivery captured exactly, stored as JSON, read back only if it can be sent again."""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

import pytest
import redis
from django.conf import settings as django_settings
from django.core import signing
from kombu import Connection, Message

from celery_orphans.entry import (
    ENTRY_VERSION,
    FORGED,
    HEADER,
    Entry,
    Unreadable,
    delivery_from_message,
    recovery_attempt,
)
from celery_orphans.ledger import Ledger
from celery_orphans.seal import SALT
from tests.factories import sealed, work_delivery, work_entry

_DROP = object()


def _raw_entry(**changes: Any) -> str:
    """A stored entry's JSON with fields changed, or left out when set to ``_DROP``."""
    data = json.loads(work_entry("t").to_json())
    data.update(changes)
    return json.dumps({k: v for k, v in data.items() if v is not _DROP})


def _delivery_json(**changes: Any) -> str:
    data = json.loads(work_entry("t").to_json())
    data["delivery"].update(changes)
    return json.dumps(data)


def test_an_entry_round_trips_every_field_of_the_delivery(ledger: Ledger) -> None:
    d = dataclasses.replace(
        work_delivery(retries=2, attempt=1),
        body=base64.b64encode(b"\x00\xff binary").decode(),
        body_encoding="base64",
        headers={
            "id": "t",
            "task": "demoapp.work",
            "retries": 2,
            "nested": {"list": [1, "two", None]},
            HEADER: {"attempt": 1},
        },
        delivery_tag=None,
    )
    e = dataclasses.replace(work_entry("t"), delivery=d, recorded_at=1234.5678)
    ledger.admit_delivery(e)

    loaded = ledger.load(["t"])["t"]

    assert loaded == e
    assert isinstance(loaded, Entry)
    assert loaded.delivery.raw_body() == b"\x00\xff binary"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        pytest.param("{not json", "unreadable ledger entry", id="not-json"),
        pytest.param(b"\xff\xfe", "authentication tag does not match", id="not-utf8"),
        pytest.param("[1, 2]", "of a known version", id="not-an-object"),
        pytest.param(_raw_entry(version=ENTRY_VERSION + 1), "of a known version", id="newer-version"),
        pytest.param(_raw_entry(version=_DROP), "of a known version", id="no-version"),
        pytest.param(_raw_entry(delivery=_DROP), "unreadable ledger entry", id="no-delivery"),
        pytest.param(_raw_entry(delivery="x"), "ledger entry has no delivery", id="delivery-not-an-object"),
        pytest.param(_raw_entry(delivery={"body": "x"}), "unreadable ledger entry", id="delivery-incomplete"),
        pytest.param(_raw_entry(surprise=1), "unreadable ledger entry", id="unknown-field"),
        pytest.param(_raw_entry(task_id=_DROP), "unreadable ledger entry", id="no-task-id"),
        pytest.param(
            _raw_entry(task_name="demoapp.other"), "another task or id", id="headers-name-another-task"
        ),
        pytest.param(_raw_entry(node=""), "node is empty", id="no-node"),
        pytest.param(_raw_entry(recorded_at=True), "not a timestamp", id="recorded-at-a-boolean"),
        pytest.param(_raw_entry(recorded_at=1e300), "is not a time", id="recorded-at-beyond-any-date"),
        pytest.param(
            work_entry("other").to_json(), "ledger entry names another task id", id="another-task-id"
        ),
        pytest.param(
            _raw_entry(recorded_at={"__type__": "nonsense", "__value__": 1}),
            "unreadable ledger entry",
            id="unknown-kombu-type-marker",
        ),
        pytest.param(
            _raw_entry(recorded_at={"__type__": "bytes", "__value__": 5}),
            "unreadable ledger entry",
            id="malformed-kombu-bytes-marker",
        ),
        pytest.param(
            _raw_entry(recorded_at={"__type__": "decimal", "__value__": "x"}),
            "unreadable ledger entry",
            id="malformed-kombu-decimal-marker",
        ),
    ],
)
def test_load_reports_an_unreadable_entry_instead_of_raising(
    ledger: Ledger, redis_client: redis.Redis, raw: str | bytes, message: str
) -> None:
    stored = sealed(raw) if isinstance(raw, str) else raw
    redis_client.hset(ledger.keys.entry("t"), mapping={"token": "tok", "entry": stored})
    ledger.admit_delivery(work_entry("good"))

    found = ledger.load(["t", "good"])

    assert isinstance(found["t"], Unreadable)
    assert message in found["t"].reason
    assert isinstance(found["good"], Entry)  # one bad entry does not hide the others


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        pytest.param({"headers": {"task": "demoapp.work"}}, "another task or id", id="headers-without-an-id"),
        pytest.param({"body_encoding": "rot13"}, "unknown body encoding", id="unknown-body-encoding"),
        pytest.param(
            {"body_encoding": "base64", "body": "not base64!"}, "not base64", id="base64-body-not-base64"
        ),
        pytest.param({"content_encoding": "no-such-codec"}, "cannot be encoded", id="unknown-codec"),
        pytest.param({"properties": {"priority": "high"}}, "'priority'", id="priority-not-a-number"),
        pytest.param({"properties": {"routing_key": "x"}}, "'routing_key'", id="unknown-property"),
        pytest.param({"properties": {"delivery_mode": 7}}, "delivery_mode", id="no-such-delivery-mode"),
        pytest.param({"exchange": "", "routing_key": ""}, "neither an exchange", id="nowhere-to-send"),
        pytest.param({"delivery_tag": 7}, "delivery_tag is int", id="delivery-tag-a-number"),
    ],
)
def test_a_delivery_that_could_not_be_sent_again_as_stored_is_unreadable(
    ledger: Ledger, redis_client: redis.Redis, changes: dict[str, Any], message: str
) -> None:
    stored = sealed(_delivery_json(**changes))
    redis_client.hset(ledger.keys.entry("t"), mapping={"token": "tok", "entry": stored})

    found = ledger.load(["t"])["t"]

    assert isinstance(found, Unreadable)
    assert message in found.reason


def _stored(redis_client: redis.Redis, ledger: Ledger, task_id: str) -> str:
    return redis_client.hget(ledger.keys.entry(task_id), "entry").decode()


def test_an_entry_is_stored_with_a_tag_over_its_exact_json(ledger: Ledger, redis_client: redis.Redis) -> None:
    entry = work_entry("t")
    ledger.admit_delivery(entry)

    text, tag = _stored(redis_client, ledger, "t").rsplit(":", 1)

    assert text == entry.to_json()
    assert tag == signing.Signer(salt=SALT, algorithm="sha256").signature(text)


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(lambda text: text.rsplit(":", 1)[0], id="no-tag"),
        pytest.param(lambda text: text.replace('"x\\": 2', '"x\\": 3'), id="body-altered"),
        pytest.param(lambda text: text.replace("demoapp.work", "demoapp.scan"), id="task-renamed"),
        pytest.param(
            lambda text: signing.Signer(salt="other", algorithm="sha256").sign(text.rsplit(":", 1)[0]),
            id="tag-of-another-salt",
        ),
        pytest.param(
            lambda text: signing.Signer(key="guess", salt=SALT, algorithm="sha256").sign(
                text.rsplit(":", 1)[0]
            ),
            id="tag-of-another-key",
        ),
    ],
)
def test_an_entry_not_sealed_by_a_key_holder_is_refused(
    ledger: Ledger, redis_client: redis.Redis, forge: Any
) -> None:
    ledger.admit_delivery(work_entry("t"))
    forged = forge(_stored(redis_client, ledger, "t"))
    redis_client.hset(ledger.keys.entry("t"), "entry", forged)

    found = ledger.load(["t"])["t"]

    assert isinstance(found, Unreadable)
    assert found.reason == FORGED


def test_a_rotated_signing_key_still_opens_entries_sealed_with_its_fallback(
    ledger: Ledger, settings: Any
) -> None:
    settings.CELERY_ORPHANS_SIGNING_KEY = "old-key-of-the-ledger"
    ledger.admit_delivery(work_entry("t"))
    settings.CELERY_ORPHANS_SIGNING_KEY = "new-key-of-the-ledger"

    assert isinstance(ledger.load(["t"])["t"], Unreadable)

    settings.CELERY_ORPHANS_SIGNING_KEY_FALLBACKS = ["old-key-of-the-ledger"]

    assert isinstance(ledger.load(["t"])["t"], Entry)


def test_one_read_of_many_entries_checks_the_tag_of_each_with_the_keys_of_that_read(
    ledger: Ledger, redis_client: redis.Redis, settings: Any
) -> None:
    settings.CELERY_ORPHANS_SIGNING_KEY = "old-key-of-the-ledger"
    ledger.admit_delivery(work_entry("old"))
    settings.CELERY_ORPHANS_SIGNING_KEY = "new-key-of-the-ledger"
    settings.CELERY_ORPHANS_SIGNING_KEY_FALLBACKS = ["old-key-of-the-ledger"]
    for task_id in ("new", "forged", "other-new"):
        ledger.admit_delivery(work_entry(task_id))
    text = _stored(redis_client, ledger, "forged").rsplit(":", 1)[0]
    redis_client.hset(
        ledger.keys.entry("forged"),
        "entry",
        signing.Signer(key="guess", salt=SALT, algorithm="sha256").sign(text),
    )

    found = ledger.load(["old", "new", "forged", "other-new"])

    assert {task_id: type(e).__name__ for task_id, e in found.items()} == {
        "old": "Entry",
        "new": "Entry",
        "forged": "Unreadable",
        "other-new": "Entry",
    }

    settings.CELERY_ORPHANS_SIGNING_KEY_FALLBACKS = []

    assert isinstance(ledger.load(["old", "new"])["old"], Unreadable)


def test_without_a_signing_key_of_its_own_the_secret_key_and_its_fallbacks_seal(
    ledger: Ledger, settings: Any
) -> None:
    ledger.admit_delivery(work_entry("t"))
    settings.SECRET_KEY_FALLBACKS = [settings.SECRET_KEY]
    settings.SECRET_KEY = "a-rotated-secret-key-for-this-test-only"

    assert isinstance(ledger.load(["t"])["t"], Entry)

    settings.SECRET_KEY_FALLBACKS = []

    assert isinstance(ledger.load(["t"])["t"], Unreadable)


def test_a_bytes_body_is_kept_as_base64_and_restored_exactly() -> None:
    raw = bytes(range(256))
    message = Message(body=raw, content_type="application/x-binary", content_encoding="binary")

    d = delivery_from_message(message)

    assert d.body_encoding == "base64"
    assert d.body == base64.b64encode(raw).decode()
    assert d.raw_body() == raw


def test_a_text_body_is_kept_as_text_and_restored_exactly() -> None:
    raw = '[["é", 1], {}, {"callbacks": null}]'
    message = Message(body=raw, content_type="application/json", content_encoding="utf-8")

    d = delivery_from_message(message)

    assert d.body_encoding == "utf-8"
    assert d.body == raw
    assert d.raw_body() == raw


def test_a_delivery_keeps_what_publishing_again_needs() -> None:
    headers = {"id": "t", "task": "demoapp.work", "retries": 1}
    message = Message(
        body=b"{}",
        delivery_tag=42,
        content_type="application/json",
        content_encoding="utf-8",
        delivery_info={"exchange": "tasks", "routing_key": "high"},
        properties={"correlation_id": "t", "reply_to": "r", "priority": 3, "delivery_mode": 2, "other": "x"},
        headers=headers,
    )

    d = delivery_from_message(message)

    assert d.headers == headers
    assert d.headers is not message.headers
    assert d.properties == {"correlation_id": "t", "reply_to": "r", "priority": 3, "delivery_mode": 2}
    assert (d.exchange, d.routing_key, d.delivery_tag) == ("tasks", "high", "42")
    assert (d.content_type, d.content_encoding) == ("application/json", "utf-8")
    assert d.retries == 1


def test_a_delivery_of_a_sparse_message_has_blank_fields_not_none() -> None:
    d = delivery_from_message(Message(body=b""))

    assert d.properties == {}
    assert (d.exchange, d.routing_key, d.delivery_tag, d.content_type, d.content_encoding) == (
        "",
        "",
        None,
        "",
        "",
    )
    assert d.headers == {}
    assert d.retries == 0
    assert d.attempt == 0


def test_a_delivery_from_a_real_redis_queue_round_trips_its_body(redis_client: redis.Redis) -> None:
    with Connection(django_settings.REDIS_URL) as conn:
        queue = conn.SimpleQueue("celery-orphans-test-ledger")
        try:
            queue.put({"args": [1, "é"]}, serializer="json", headers={"retries": 4})
            message = queue.get(timeout=5)
            d = delivery_from_message(message)
            message.ack()
        finally:
            queue.close()

    assert d.raw_body() == message.body
    assert d.retries == 4
    assert d.routing_key == "celery-orphans-test-ledger"


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        pytest.param(None, 0, id="no-headers"),
        pytest.param({}, 0, id="empty"),
        pytest.param({HEADER: {"attempt": 2}}, 2, id="attempt-2"),
        pytest.param({HEADER: {}}, 0, id="meta-without-attempt"),
        pytest.param({HEADER: None}, 0, id="meta-none"),
        pytest.param({HEADER: "2"}, 0, id="meta-a-string"),
        pytest.param({HEADER: [2]}, 0, id="meta-a-list"),
        pytest.param({HEADER: 2}, 0, id="meta-an-int"),
        pytest.param({HEADER: True}, 0, id="meta-a-bool"),
        pytest.param({HEADER: {"attempt": True}}, 0, id="attempt-a-bool"),
        pytest.param({HEADER: {"attempt": "2"}}, 0, id="attempt-a-string"),
        pytest.param({HEADER: {"attempt": 2.0}}, 0, id="attempt-a-float"),
        pytest.param({HEADER: {"attempt": None}}, 0, id="attempt-none"),
    ],
)
def test_recovery_attempt_reads_only_a_well_formed_header(
    headers: dict[str, Any] | None, expected: int
) -> None:
    assert recovery_attempt(headers) == expected


@pytest.mark.parametrize(
    ("retries", "expected"),
    [
        pytest.param(3, 3, id="int"),
        pytest.param(None, 0, id="none"),
        pytest.param("3", 0, id="string"),
    ],
)
def test_delivery_retries_reads_only_an_integer(retries: object, expected: int) -> None:
    d = dataclasses.replace(work_delivery(), headers={"retries": retries})

    assert d.retries == expected
