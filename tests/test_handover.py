"""A prefork pool process that died is reaped as soon as the kernel lets it (worker/handover.py): its
sentinel can fire while it is not yet waitable, and Celery would then not look again for up to 5 s."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from billiard import Process
from kombu.asynchronous import Hub

from celery_orphans.worker import handover


def _close_files_then_wait() -> None:
    """A child whose sentinel fires while it lives on: the moment between a dying process's files being
    closed and its becoming waitable, held open."""
    os.closerange(3, 4096)
    time.sleep(60)


class AsynPoolStandIn:
    """What the wrap uses of Celery's ``AsynPool``: the sentinel's callback, which reaps what has exited
    (here: nothing yet), and the maintenance, which finds the exited process."""

    def __init__(self) -> None:
        self.maintained = 0

    def _event_process_exit(self, hub: Any, proc: Any) -> None:
        pass  # Celery: stop watching the sentinel, maintain the pool; the process is not waitable yet

    def maintain_pool(self) -> None:
        self.maintained += 1


def test_a_pool_process_whose_sentinel_fired_before_it_was_waitable_is_reaped_once_it_is() -> None:
    pool, hub = AsynPoolStandIn(), Hub()
    handover._reap_when_waitable(pool)
    child = Process(target=_close_files_then_wait)
    child.start()
    try:
        pool._event_process_exit(hub, child)  # the sentinel fired: not reaped, so looked at again
        hub.fire_timers(propagate=(Exception,))
        assert child.exitcode is None and pool.maintained == 0
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while pool.maintained == 0 and time.monotonic() < deadline:
            time.sleep(handover.REAP_RETRY_SECONDS)
            hub.fire_timers(propagate=(Exception,))
        assert pool.maintained == 1
        assert child.exitcode == -signal.SIGKILL
    finally:
        if child.exitcode is None:
            os.kill(child.pid, signal.SIGKILL)
            child.join()


def test_a_pool_process_reaped_when_its_sentinel_fired_is_not_looked_at_again() -> None:
    pool, hub = AsynPoolStandIn(), Hub()
    handover._reap_when_waitable(pool)
    child = Process(target=time.sleep, args=(0,))
    child.start()
    child.join()
    pool._event_process_exit(hub, child)
    hub.fire_timers(propagate=(Exception,))
    assert pool.maintained == 0 and len(hub.timer) == 0


def test_a_pool_is_wrapped_once() -> None:
    pool = AsynPoolStandIn()
    handover._reap_when_waitable(pool)
    wrapped = pool._event_process_exit
    handover._reap_when_waitable(pool)
    assert pool._event_process_exit is wrapped
