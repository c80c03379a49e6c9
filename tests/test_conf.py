from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from pytest_django import Settings
from testproject.celery import app

from celery_orphans import conf
from celery_orphans.conf import Setting, settings
from tests.celery_conf import patch_setting

SetBroker = Callable[[Any], None]


@pytest.fixture
def clean(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """No CELERY_ORPHANS_* Django setting or environment variable, whatever the test project sets."""
    for setting in conf.settings.all():
        if hasattr(django_settings, setting.django_name):
            delattr(settings, setting.django_name)
        monkeypatch.delenv(setting.django_name, raising=False)
    return settings


@pytest.fixture
def set_broker(monkeypatch: pytest.MonkeyPatch) -> SetBroker:
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)  # Celery's conf would prefer it
    return lambda url: patch_setting(monkeypatch, app.conf, "broker_url", url)


def test_every_setting_is_listed_with_its_prefixed_name() -> None:
    names = [setting.name for setting in settings.all()]
    assert len(names) == len(set(names))
    assert set(names) >= {
        "ENABLED",
        "GRACE_SECONDS",
        "MAX_ATTEMPTS",
        "ATTEMPTS_WINDOW_SECONDS",
        "REDIS_URL",
        "GROUPS",
        "SWEEP_INTERVAL_SECONDS",
        "HEARTBEAT_SECONDS",
        "LEASE_SECONDS",
        "INSPECT_TIMEOUT_SECONDS",
        "BOOT_SWEEP",
        "KEY_PREFIX",
    }
    assert all(setting.django_name == f"CELERY_ORPHANS_{setting.name}" for setting in settings.all())
    assert isinstance(type(settings).MAX_ATTEMPTS, Setting)


def test_documented_defaults_when_neither_setting_nor_environment(clean: Settings) -> None:
    assert settings.ENABLED is False
    assert settings.GRACE_SECONDS == 5.0
    assert settings.MAX_ATTEMPTS == 3
    assert settings.ATTEMPTS_WINDOW_SECONDS == 86_400
    assert settings.REDIS_URL is None
    assert settings.GROUPS == {}
    assert settings.SWEEP_INTERVAL_SECONDS == 5
    assert settings.HEARTBEAT_SECONDS == 2.0
    assert settings.LEASE_SECONDS == 10.0
    assert settings.INSPECT_TIMEOUT_SECONDS == 1.0
    assert settings.LEDGER_HOLD_SECONDS == 60.0
    assert settings.BOOT_SWEEP is True
    assert settings.KEY_PREFIX == "celery_orphans"


def test_environment_variable_wins_over_default(clean: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CELERY_ORPHANS_MAX_ATTEMPTS", "7")
    assert settings.MAX_ATTEMPTS == 7


def test_django_setting_wins_over_environment_variable(
    clean: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CELERY_ORPHANS_MAX_ATTEMPTS", "7")
    clean.CELERY_ORPHANS_MAX_ATTEMPTS = 5
    assert settings.MAX_ATTEMPTS == 5


def test_read_lazily_on_every_access(clean: Settings) -> None:
    default = settings.GRACE_SECONDS
    with override_settings(CELERY_ORPHANS_GRACE_SECONDS=default + 2.5):
        assert default + 2.5 == settings.GRACE_SECONDS
    assert default == settings.GRACE_SECONDS


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("ENABLED", "true", True),
        ("ENABLED", " Yes ", True),
        ("ENABLED", "0", False),
        ("ENABLED", "off", False),
        ("GRACE_SECONDS", "2.5", 2.5),
        ("GRACE_SECONDS", "0", 0.0),
        ("MAX_ATTEMPTS", "4", 4),
        ("HEARTBEAT_SECONDS", "0.5", 0.5),
        ("GROUPS", '{"summaries": false, "reports": "on"}', {"summaries": False, "reports": True}),
        ("REDIS_URL", "redis://cache:6379/2", "redis://cache:6379/2"),
        ("REDIS_URL", "", None),
        ("KEY_PREFIX", "myapp", "myapp"),
    ],
)
def test_environment_strings_are_parsed(
    clean: Settings, monkeypatch: pytest.MonkeyPatch, name: str, raw: str, expected: object
) -> None:
    monkeypatch.setenv(f"CELERY_ORPHANS_{name}", raw)
    value = getattr(settings, name)
    assert value == expected
    assert type(value) is type(expected)


def test_django_setting_values_are_parsed_too(clean: Settings) -> None:
    clean.CELERY_ORPHANS_MAX_ATTEMPTS = 2.0
    clean.CELERY_ORPHANS_GROUPS = {"summaries": "false"}
    assert settings.MAX_ATTEMPTS == 2
    assert type(settings.MAX_ATTEMPTS) is int
    assert settings.GROUPS == {"summaries": False}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("GRACE_SECONDS", -1),
        ("MAX_ATTEMPTS", 0),
        ("MAX_ATTEMPTS", 2.5),
        ("MAX_ATTEMPTS", True),
        ("MAX_ATTEMPTS", "three"),
        ("ATTEMPTS_WINDOW_SECONDS", 0),
        ("ENABLED", "maybe"),
        ("ENABLED", 1),
        ("GROUPS", ["summaries"]),
        ("HEARTBEAT_SECONDS", 0),
        ("LEASE_SECONDS", -5.0),
        ("REDIS_URL", 6379),
        ("KEY_PREFIX", ""),
        ("KEY_PREFIX", "two words"),
    ],
)
def test_bad_django_setting_names_itself_and_the_value(clean: Settings, name: str, value: object) -> None:
    setattr(clean, f"CELERY_ORPHANS_{name}", value)
    with pytest.raises(ImproperlyConfigured) as raised:
        getattr(settings, name)
    assert f"CELERY_ORPHANS_{name}" in str(raised.value)
    assert repr(value) in str(raised.value)


def test_bad_group_switch_names_the_group_and_the_value(clean: Settings) -> None:
    clean.CELERY_ORPHANS_GROUPS = {"summaries": "perhaps"}
    with pytest.raises(ImproperlyConfigured, match=r"CELERY_ORPHANS_GROUPS\['summaries'\] .*'perhaps'"):
        settings.GROUPS  # noqa: B018


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("GROUPS", "{not json"),
        ("GROUPS", '["summaries"]'),
        ("ENABLED", "maybe"),
        ("ENABLED", ""),
        ("MAX_ATTEMPTS", "0"),
        ("MAX_ATTEMPTS", "1.5"),
        ("GRACE_SECONDS", "-0.1"),
    ],
)
def test_bad_environment_variable_names_itself_and_the_value(
    clean: Settings, monkeypatch: pytest.MonkeyPatch, name: str, raw: str
) -> None:
    monkeypatch.setenv(f"CELERY_ORPHANS_{name}", raw)
    with pytest.raises(ImproperlyConfigured) as raised:
        getattr(settings, name)
    assert f"CELERY_ORPHANS_{name}" in str(raised.value)


def test_bad_json_in_the_environment_shows_the_raw_text(
    clean: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CELERY_ORPHANS_GROUPS", "{not json")
    with pytest.raises(ImproperlyConfigured, match=r"CELERY_ORPHANS_GROUPS .*'\{not json'"):
        settings.GROUPS  # noqa: B018


def test_unknown_names_are_found_in_settings_and_environment_and_never_a_known_one(
    clean: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    for setting in settings.all():
        setattr(clean, setting.django_name, setting.default)
        monkeypatch.setenv(setting.django_name, "1")
    assert settings.unknown_in_settings() == settings.unknown_in_environment() == []

    clean.CELERY_ORPHANS_SHADOWMODE = True
    monkeypatch.setenv("Celery_Orphans_Watch", "false")
    assert settings.unknown_in_settings() == [
        conf.UnknownName("CELERY_ORPHANS_SHADOWMODE", "CELERY_ORPHANS_SHADOW_MODE")
    ]
    assert settings.unknown_in_environment() == [
        conf.UnknownName("Celery_Orphans_Watch", "CELERY_ORPHANS_WATCH")
    ]

    del clean.CELERY_ORPHANS_SHADOWMODE  # read at each call, as every setting is
    assert settings.unknown_in_settings() == []


def test_redis_url_setting_is_used_first(clean: Settings, set_broker: SetBroker) -> None:
    set_broker("redis://broker:6379/0")
    clean.CELERY_ORPHANS_REDIS_URL = "redis://orphans:6379/3"
    assert settings.redis_url() == "redis://orphans:6379/3"


@pytest.mark.parametrize(
    ("broker", "expected"),
    [
        ("redis://broker:6379/0", "redis://broker:6379/0"),
        ("rediss://:secret@broker:6380/1", "rediss://:secret@broker:6380/1"),
        (["redis://first:6379/0", "redis://second:6379/0"], "redis://first:6379/0"),
        ("sentinel://a:26379/1;sentinel://b:26379/1", "sentinel://a:26379/1;sentinel://b:26379/1"),
        (["sentinel://a:26379", "sentinel://b:26379"], "sentinel://a:26379;sentinel://b:26379"),
    ],
)
def test_redis_url_falls_back_to_a_redis_broker(
    clean: Settings, set_broker: SetBroker, broker: object, expected: str
) -> None:
    set_broker(broker)
    assert settings.redis_url() == expected


@pytest.mark.parametrize("broker", ["amqp://guest:guest@127.0.0.1:5672//", None])
def test_redis_url_missing_without_a_redis_broker(
    clean: Settings, set_broker: SetBroker, broker: object
) -> None:
    set_broker(broker)
    with pytest.raises(ImproperlyConfigured, match="CELERY_ORPHANS_REDIS_URL is not set"):
        settings.redis_url()


def test_the_sentinel_master_is_the_setting_else_the_brokers_transport_option(
    clean: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    patch_setting(monkeypatch, app.conf, "broker_transport_options", {"master_name": "from-broker"})
    assert settings.sentinel_master() == "from-broker"

    clean.CELERY_ORPHANS_REDIS_SENTINEL_MASTER = "mine"
    assert settings.sentinel_master() == "mine"


def test_a_sentinel_url_without_a_master_name_is_refused(
    clean: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    patch_setting(monkeypatch, app.conf, "broker_transport_options", {})
    with pytest.raises(ImproperlyConfigured, match="CELERY_ORPHANS_REDIS_SENTINEL_MASTER"):
        settings.sentinel_master()


def test_nothing_is_written_into_django_settings(clean: Settings, set_broker: SetBroker) -> None:
    set_broker("redis://broker:6379/0")
    before = {name for name in dir(django_settings) if name.startswith("CELERY_ORPHANS_")}
    for setting in settings.all():
        setting.read()
    settings.redis_url()
    after = {name for name in dir(django_settings) if name.startswith("CELERY_ORPHANS_")}
    assert before == after == set()
