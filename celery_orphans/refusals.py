"""The one error mapping of the three doors (``operations``): a fault of a service an operation needs, a
lock held elsewhere, the master switch off or a configuration that cannot work becomes ``Refused``, a
sentence with its cause, never a traceback or a 500, and never a library's text with a password in it."""

from __future__ import annotations

import contextlib
import enum
import re
from collections.abc import Iterator

import redis
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError
from kombu.exceptions import KombuError

from celery_orphans import logs
from celery_orphans.exceptions import CeleryOrphansError, LedgerUnavailable, SweepLocked

logger = logs.get(__name__)


class Problem(str, enum.Enum):
    """Why an operation did nothing."""

    LOCKED = "locked"  # another sweep holds the lock
    SWITCHED_OFF = "switched_off"  # CELERY_ORPHANS_ENABLED is off and the operation changes things
    UNAVAILABLE = "unavailable"  # Redis, the database or the broker cannot be reached
    MISCONFIGURED = "misconfigured"  # a setting makes the operation impossible


class Refused(CeleryOrphansError):
    """An operation did nothing, for ``problem``; the message says why, with its cause."""

    def __init__(self, problem: Problem, message: str) -> None:
        super().__init__(message)
        self.problem = problem


_CREDENTIALS = re.compile(r"(?P<scheme>\w[\w+.-]*://)[^\s/@:]*:[^\s/@]*@")
_PASSWORD = re.compile(r"(?i)(?P<key>password\s*[=:]\s*)\S+")


def cause(exc: BaseException) -> str:
    """An exception as an operator may read it: its type and text, with any credentials masked."""
    text = _PASSWORD.sub(r"\g<key>***", _CREDENTIALS.sub(r"\g<scheme>***@", str(exc)))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@contextlib.contextmanager
def mapped() -> Iterator[None]:
    """The one error mapping: a fault of a service an operation needs becomes ``Refused``, which says which
    service and the fault's kind; the library's own text (hosts, paths, a query) goes to the log only."""
    try:
        yield
    except Refused:
        raise
    except SweepLocked as exc:
        raise Refused(Problem.LOCKED, str(exc)) from exc
    except LedgerUnavailable as exc:
        raise _unavailable("Redis", exc.__cause__ or exc) from exc
    except redis.RedisError as exc:
        raise _unavailable("Redis", exc) from exc
    except DatabaseError as exc:
        raise _unavailable("the database", exc) from exc
    except (KombuError, OSError) as exc:
        raise _unavailable("the broker", exc) from exc
    except ImproperlyConfigured as exc:
        raise Refused(Problem.MISCONFIGURED, str(exc)) from exc


def _unavailable(service: str, exc: BaseException) -> Refused:
    logger.error("cannot reach %s: %s", service, cause(exc))
    return Refused(
        Problem.UNAVAILABLE, f"cannot reach {service} ({type(exc).__name__}; see the server's log)"
    )
