"""The remote command that flags tasks revoked on a worker, leaving their rows alone (worker/control.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery.worker import state as worker_state
from celery.worker.control import Panel

from celery_orphans.recovery.broker import REVOKE_COMMAND
from celery_orphans.worker import control


@pytest.fixture(autouse=True)
def revoked() -> Iterator[None]:
    before = set(worker_state.revoked)
    yield
    worker_state.revoked.clear()
    worker_state.revoked.update(before)


def test_the_command_is_registered_under_the_name_the_sweep_broadcasts():
    assert Panel.data[REVOKE_COMMAND] is control.revoke


def test_it_flags_the_ids_revoked_and_answers_as_celerys_commands_do():
    reply = control.revoke(None, ["t-1", "t-2"])

    assert {"t-1", "t-2"} <= set(worker_state.revoked)
    assert reply == {"ok": "2 tasks flagged as revoked"}


def test_one_id_alone_is_taken_as_a_list_of_one():
    assert control.revoke(None, "t-3") == {"ok": "1 tasks flagged as revoked"}
    assert "t-3" in worker_state.revoked
