from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.app.defaults import DEFAULTS

from celery_orphans import recommended_celery_settings

RECOMMENDED = {
    "task_acks_late": True,
    "worker_prefetch_multiplier": 1,
    "task_reject_on_worker_lost": True,
    "task_track_started": True,
    "result_extended": True,
    "worker_soft_shutdown_timeout": 60.0,
    "worker_deduplicate_successful_tasks": True,
    "broker_transport_options": {"visibility_timeout": 3600},
}


def test_holds_every_recommended_setting() -> None:
    assert recommended_celery_settings() == RECOMMENDED


def test_every_name_is_a_celery_setting() -> None:
    assert set(recommended_celery_settings()) <= set(DEFAULTS)


def test_arguments_set_the_timeouts() -> None:
    chosen = recommended_celery_settings(visibility_timeout=7200, soft_shutdown_timeout=25)
    assert chosen == {
        **RECOMMENDED,
        "broker_transport_options": {"visibility_timeout": 7200},
        "worker_soft_shutdown_timeout": 25,
    }


def test_each_call_returns_a_new_dict() -> None:
    first = recommended_celery_settings()
    first["broker_transport_options"]["visibility_timeout"] = 1
    assert recommended_celery_settings()["broker_transport_options"] == {"visibility_timeout": 3600}


def test_app_conf_update_accepts_it(fresh_app: Celery) -> None:
    app = fresh_app
    app.conf.update(recommended_celery_settings(visibility_timeout=900))
    assert app.conf.task_acks_late is True
    assert app.conf.worker_prefetch_multiplier == 1
    assert app.conf.task_reject_on_worker_lost is True
    assert app.conf.task_track_started is True
    assert app.conf.result_extended is True
    assert app.conf.worker_soft_shutdown_timeout == 60.0
    assert app.conf.worker_deduplicate_successful_tasks is True
    assert app.conf.broker_transport_options == {"visibility_timeout": 900}


def test_django_settings_with_the_celery_namespace_accept_it(fresh_app: Celery) -> None:
    django_style = SimpleNamespace(
        **{f"CELERY_{name.upper()}": value for name, value in recommended_celery_settings().items()}
    )
    app = fresh_app
    app.config_from_object(django_style, namespace="CELERY")
    for name, value in RECOMMENDED.items():
        assert app.conf[name] == value, name


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"visibility_timeout": 0}, "visibility_timeout must be positive, got 0"),
        ({"visibility_timeout": -60}, "visibility_timeout must be positive, got -60"),
        ({"soft_shutdown_timeout": -1.0}, r"soft_shutdown_timeout must be positive .*, got -1.0"),
        ({"soft_shutdown_timeout": 0}, r"soft_shutdown_timeout must be positive .*, got 0"),
    ],
)
def test_bad_arguments_are_a_value_error(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        recommended_celery_settings(**kwargs)
