"""Worker leases against a real Redis: the key a heartbeat keeps alive, and what the sweep reads from it."""

from __future__ import annotations

import os
import re

import pytest

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
