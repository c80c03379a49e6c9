"""Changing one Celery setting of an app configured from Django settings, for a test.

The test project's app reads its Django settings under the ``CELERY`` namespace. Celery 5.5 then looks
a setting up under its namespaced name (``CELERY_BROKER_URL``) before its plain one (``broker_url``),
wherever either was written, so a value written under the plain name alone is not seen; later releases
see it. Writing both names works on every release the package supports.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import pytest


def names(key: str) -> tuple[str, str]:
    return key, f"CELERY_{key.upper()}"


def set_setting(conf: MutableMapping[str, Any], key: str, value: Any) -> None:
    for name in names(key):
        conf[name] = value


def patch_setting(
    monkeypatch: pytest.MonkeyPatch, conf: MutableMapping[str, Any], key: str, value: Any
) -> None:
    """``set_setting`` that ``monkeypatch`` undoes after the test.

    The value the app reads now is recorded under both names before either changes: on releases that
    take the two names for one setting, changing one changes what the other reads.
    """
    original = conf.get(key)
    for name in names(key):
        monkeypatch.setitem(conf, name, original)
    set_setting(conf, key, value)
