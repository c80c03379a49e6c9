"""Settings for the test suite: a Redis database of its own (emptied by tests), everything else shared."""

import os

os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/9")

from testproject.settings import *  # noqa: F403

# Short leases so that a killed worker is provably gone within a couple of seconds. Environment
# variables, not settings, so a test can start a worker with the production defaults.
os.environ.setdefault("CELERY_ORPHANS_HEARTBEAT_SECONDS", "0.5")
os.environ.setdefault("CELERY_ORPHANS_LEASE_SECONDS", "2")
