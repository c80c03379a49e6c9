"""Settings for the test suite: a Redis server and a database of the run's own (see tests/services.py)."""

import os
import tempfile

from tests import services

services.provide_for_tests()

from testproject.settings import *  # noqa: E402, F403
from testproject.settings import DATABASES  # noqa: E402

DATABASES["default"]["TEST"] = {"NAME": services.TEST_DATABASE_NAME}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # A file, not memory: the workers and commands a test starts open it too.
    DATABASES["default"]["TEST"]["NAME"] = os.path.join(
        tempfile.gettempdir(), f"{services.TEST_DATABASE_NAME}.sqlite3"
    )

# Short leases so that a killed worker is provably gone within a couple of seconds. Environment
# variables, not settings, so a test can start a worker with the production defaults.
# Each test sees the running tasks as they are now, not as a load a moment earlier judged them
# (tests/test_inflight.py turns the sharing on where it is the subject).
os.environ.setdefault("CELERY_ORPHANS_IN_FLIGHT_CACHE_SECONDS", "0")
os.environ.setdefault("CELERY_ORPHANS_HEARTBEAT_SECONDS", "0.5")
os.environ.setdefault("CELERY_ORPHANS_LEASE_SECONDS", "2")
# One Redis on this machine, read by every worker with the same clock: no skew to cover.
os.environ.setdefault("CELERY_ORPHANS_CLOCK_SKEW_SECONDS", "0.1")
