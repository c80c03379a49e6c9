"""How celery-orphans logs: to ``celery_orphans.<module>``, every line starting ``celery-orphans:``.

The logger's name says whose a line is wherever a format shows it, but Celery's worker log format does
not (``[time: LEVEL/process] message``), and that is where most of these lines are read. So the name
goes into the line once, here, rather than into each message.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

import redis

PREFIX = "celery-orphans: "

if TYPE_CHECKING:
    Logger = logging.LoggerAdapter[logging.Logger]
else:
    Logger = logging.LoggerAdapter


class _Named(Logger):
    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"{PREFIX}{msg}", kwargs


def get(name: str) -> Logger:
    """The logger of module ``name``, whose lines start with ``celery-orphans:``."""
    return _Named(logging.getLogger(name), {})


@contextlib.contextmanager
def redis_fault_let_go(logger: Logger, message: str, *args: object) -> Iterator[None]:
    """Run the block; a Redis fault in it is logged as a warning (``<message>: <error>``, ``message``
    formatted with ``args``) and let go. For the steps whose failure is harmless: what they do lapses, or
    the next sweep does it."""
    try:
        yield
    except redis.RedisError as exc:
        logger.warning(f"{message}: %s", *args, exc)
