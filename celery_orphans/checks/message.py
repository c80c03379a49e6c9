"""What every celery-orphans check reports: a message whose level follows the letter of its ID."""

from __future__ import annotations

from django.core import checks

TAG = "celery_orphans"

_LEVELS: dict[str, type[checks.Error | checks.Warning | checks.Info]] = {
    "E": checks.Error,
    "W": checks.Warning,
    "I": checks.Info,
}


def message(code: str, msg: str, hint: str, obj: object = None) -> checks.CheckMessage:
    """A message whose level follows the letter of its ID: E, W or I."""
    return _LEVELS[code[0]](msg, hint=hint, obj=obj, id=f"celery_orphans.{code}")
