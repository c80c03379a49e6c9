"""The serializers of recoverable tasks, checked ahead of time (E012, W006).

A recovery sends a task's exact message again only when its body is data
(``rules.SAFE_CONTENT_TYPES``); a pickled message is never sent again, so an orphan of a ``@recoverable`` task
that pickles is marked terminal at its first incident. These checks say so before that incident.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from celery import current_app
from django.core import checks
from kombu.serialization import registry as serializers  # type: ignore[attr-defined]  # not in the stubs

from celery_orphans.registry import load_tasks, recoverable_tasks
from celery_orphans.rules import SAFE_CONTENT_TYPES

_HINT = (
    'Use a data serializer: task_serializer = "json" (Celery\'s default), or serializer="json" on the task.'
)


def content_type(serializer: str) -> str:
    """The content type a serializer's messages carry (a content type names itself)."""
    return str(serializers.name_to_type.get(serializer, serializer))


def _unsafe(names: Iterable[str]) -> list[str]:
    return [name for name in names if content_type(name) not in SAFE_CONTENT_TYPES]


def check_serializers(**kwargs: Any) -> list[checks.CheckMessage]:
    """E012 for each recoverable task whose messages are pickled; W006 when workers accept pickle."""
    load_tasks(current_app)
    recoverable = sorted(recoverable_tasks(current_app))
    found: list[checks.CheckMessage] = [
        checks.Error(
            f"Recoverable task {name!r} is sent with the {serializer!r} serializer: a recovery never sends "
            "a pickled message again, so its orphans are marked terminal instead.",
            hint=_HINT,
            obj=name,
            id="celery_orphans.E012",
        )
        for name in recoverable
        for serializer in [str(current_app.tasks[name].serializer)]
        if _unsafe([serializer])
    ]
    accepted = _unsafe(str(a) for a in current_app.conf.accept_content or ())
    if recoverable and accepted:
        found.append(
            checks.Warning(
                f"accept_content allows {', '.join(map(repr, accepted))}: a recoverable task sent with "
                "apply_async(serializer='pickle') is not sent again when its worker dies.",
                hint='Accept data serializers only: accept_content = ["json"] (Celery\'s default).',
                id="celery_orphans.W006",
            )
        )
    return found
