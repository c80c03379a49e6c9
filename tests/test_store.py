"""Worker leases against a real Redis: the key a heartbeat keeps alive, and what the sweep reads from it."""

from __future__ import annotations

import os

from celery_orphans import store
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
