"""Settings for the test suite: a Redis database of its own (emptied by tests), everything else shared."""

import os

os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/9")

from testproject.settings import *  # noqa: E402,F403
