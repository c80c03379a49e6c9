"""The ledger's Redis client: one per process and URL, and the URLs it takes."""

from __future__ import annotations

import os
import re

import pytest
import redis
from django.core.exceptions import ImproperlyConfigured
from pytest_django import Settings

from celery_orphans import store
from celery_orphans.store import SentinelTarget
from tests.helpers import exit_code_of


def test_a_forked_child_gets_its_client_even_if_the_fork_caught_the_heartbeat_getting_one() -> None:
    store._clients_lock.acquire()  # as if the heartbeat's thread were in client() when the worker forked
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = 0 if store.client().ping() else 2
            finally:
                os._exit(code)
    finally:
        store._clients_lock.release()

    assert exit_code_of(pid) == 0


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("sentinel://127.0.0.1:26379", SentinelTarget((("127.0.0.1", 26379),), 0, None, None)),
        (
            "sentinel://:s%40cret@a:26380/2;sentinel://b:26381;sentinel://c",
            SentinelTarget((("a", 26380), ("b", 26381), ("c", 26379)), 2, None, "s@cret"),
        ),
        ("sentinel://user:pw@a:1/0; sentinel://b:2/5", SentinelTarget((("a", 1), ("b", 2)), 0, "user", "pw")),
    ],
)
def test_a_sentinel_url_names_every_sentinel_and_the_first_urls_database_and_credentials(
    url: str, expected: SentinelTarget
) -> None:
    assert SentinelTarget.from_url(url) == expected


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("sentinel://a:1;redis://b:2", "sentinel://host:port addresses"),
        ("sentinel://", "sentinel://host:port addresses"),
        ("sentinel://a:1/zero", "the database of a sentinel URL is a number, got 'zero'"),
    ],
)
def test_a_bad_sentinel_url_says_what_is_wrong(url: str, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        SentinelTarget.from_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://:pw@redis.internal/12",
        "rediss://h:6380/0?ssl_cert_reqs=required",
        "valkey://h:6379/1",
        "valkeys://h",
        "redis://h:6379//",  # kombu's form of database 0
        "unix:///run/redis.sock?db=2",
        "sentinel://a:26379;sentinel://b:26379",
    ],
)
def test_a_url_a_client_can_use_has_no_problem(url: str) -> None:
    assert store.url_problem(url) is None


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://:pw-s3cret@127.0.0.1:6379/0", "has the scheme 'http'; the ledger needs redis://"),
        ("pw-s3cret", "is not a URL"),
        ("redis://", "names no host"),
        ("redis://:pw-s3cret@/0", "names no host"),
        ("redis://:6379/0", "names no host"),  # ${REDIS_HOST} was empty
        ("redis://h:99999/0", "has a port that is not a number"),
        ("redis://:pw-s3cret@h:port/0", "has a port that is not a number"),
        ("redis://:pw-s3cret@h:6379/pw-s3cret", "has a database that is not a number"),
        ("unix://", "names no socket"),
        ("sentinel://:pw-s3cret@a:1/x", "is not a valid sentinel URL"),
    ],
)
def test_a_url_no_client_can_use_says_why_without_repeating_it(url: str, problem: str) -> None:
    found = store.url_problem(url)
    assert found is not None
    assert found.startswith(problem)
    assert "pw-s3cret" not in found


def test_a_brokers_url_is_read_as_kombu_reads_it() -> None:
    assert store.url_problem("redis://", from_broker=True) is None  # kombu's localhost
    assert store.url_problem("redis://h:6379/vhost", from_broker=True) is None
    assert store.url_problem("sentinel://", from_broker=True) is not None


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://:pw-s3cret@10.0.0.5:6380/1", "10.0.0.5:6380"),
        ("rediss://user:pw-s3cret@cache.internal/0", "cache.internal:6379"),
        ("sentinel://:pw-s3cret@a:26380/0;sentinel://b", "a:26380, b:26379"),
        ("unix:///run/redis.sock", "/run/redis.sock"),
    ],
)
def test_the_address_of_a_url_for_a_log_line_holds_no_credential(url: str, expected: str) -> None:
    assert store.address(url) == expected


@pytest.mark.parametrize("scheme", ["valkey", "VALKEY"])
def test_a_valkey_url_reaches_the_server(
    settings: Settings, own_clients: None, redis_client: redis.Redis, scheme: str
) -> None:
    settings.CELERY_ORPHANS_REDIS_URL = scheme + settings.REDIS_URL[len("redis") :]
    assert store.client().ping()


def test_a_client_is_refused_for_a_url_no_client_can_use(settings: Settings, own_clients: None) -> None:
    settings.CELERY_ORPHANS_REDIS_URL = "http://:pw-s3cret@127.0.0.1:6379/0"
    with pytest.raises(
        ImproperlyConfigured, match=r"^CELERY_ORPHANS_REDIS_URL has the scheme 'http'"
    ) as raised:
        store.client()
    assert "pw-s3cret" not in str(raised.value)
