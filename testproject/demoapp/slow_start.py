"""For tests: a worker whose consumer takes ``TESTPROJECT_SLOW_CONSUMER_START`` seconds longer to start,
as a slow broker link or a long mingle makes it: the time between the pool's start and the subscription."""

import os
import time
from typing import Any

from celery import bootsteps, current_app


class SlowConsumerStart(bootsteps.StartStopStep):
    requires = ("celery.worker.consumer.connection:Connection",)

    def start(self, parent: Any) -> None:
        time.sleep(float(os.environ["TESTPROJECT_SLOW_CONSUMER_START"]))


if os.environ.get("TESTPROJECT_SLOW_CONSUMER_START"):
    current_app.steps["consumer"].add(SlowConsumerStart)
