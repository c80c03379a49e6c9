"""The boot sweep: a booting worker recovers what an earlier boot of its node name left running.

It does not wait for Beat. Those tasks' process is gone by definition, unless another live process uses
the same name: then they are left to the regular sweep, which asks the workers.
"""

from __future__ import annotations

import threading
from datetime import datetime

from celery import Celery
from celery.worker import state

from celery_orphans import leases, logs
from celery_orphans.choices import Trigger
from celery_orphans.conf import settings
from celery_orphans.sweep.background import sweep_giving_way
from celery_orphans.sweep.values import BootScope, Options

logger = logs.get(__name__)


def sweep_in_background(app: Celery | None, node: str, boot: str, booted_at: datetime) -> None:
    """Run the boot sweep of ``node``'s boot ``boot`` in a thread of its own."""
    threading.Thread(
        target=sweep_at_boot,
        args=(app, node, boot, booted_at),
        name="celery-orphans-boot-sweep",
        daemon=True,
    ).start()


def _held_now() -> frozenset[str]:
    return frozenset(state.requests)


def sweep_at_boot(app: Celery | None, node: str, boot: str, booted_at: datetime) -> None:
    """Recover the tasks an earlier boot of ``node`` left behind."""

    def options() -> Options | None:
        # Without pruning: the record of an earlier boot seen to exit is what lets the watch's sweep,
        # started at the same moment, judge that boot's tasks within their grace.
        others = leases.fresh_boots([node], prune=False).get(node, frozenset()) - {boot}
        # A boot killed a moment ago still has a lease; a live twin renews it within a heartbeat, and a
        # twin stalled meanwhile (a frozen process) renews it when it runs again, before it lapses. So
        # each is watched until its lease is renewed or lapses (at once for a process seen to have exited
        # on this machine): until then its tasks may be running.
        twins = leases.renewed_within(node, others, settings.LEASE_SECONDS + settings.HEARTBEAT_SECONDS)
        if twins:
            logger.warning(
                "another live worker holds the name %s (boots %s); two workers share a name, "
                "so their tasks are left to the regular sweep",
                node,
                ", ".join(sorted(twins)),
            )
            return None
        # A boot whose process was seen to exit on this machine is recorded gone, as the watch records it:
        # its lease, which may not have lapsed yet, no longer keeps its tasks from this sweep.
        leases.record_exits(node, others)
        scope = BootScope(node, boot, booted_at, _held_now)
        return Options(trigger=Trigger.WORKER_BOOT, grace_seconds=0, boot=scope)

    # The sweep logs its own summary (at INFO when it acted) and each action: no second line here.
    sweep_giving_way(f"boot sweep of {node}", options, app)
