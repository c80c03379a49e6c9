"""One setting, read lazily: the Django setting ``CELERY_ORPHANS_<NAME>``, else the environment variable
of the same name, else its default; and the parsers that check a value read from either.

A value from the environment is a string: each parser takes the string or the Python value alike.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured

PREFIX = "CELERY_ORPHANS_"
T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _invalid(name: str, value: object, expected: str) -> ImproperlyConfigured:
    return ImproperlyConfigured(f"{PREFIX}{name} must be {expected}, got {value!r}.")


def boolean(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _invalid(name, value, "a boolean (true/false)")


def _number(name: str, value: object, *, minimum: float, integer: bool) -> Any:
    if isinstance(value, bool):
        raise _invalid(name, value, "a number")
    try:
        number = int(value) if integer else float(value)  # type: ignore[arg-type,call-overload]
    except (TypeError, ValueError):
        raise _invalid(name, value, "an integer" if integer else "a number") from None
    if not math.isfinite(number):
        raise _invalid(name, value, "a finite number")
    if integer and isinstance(value, float) and not value.is_integer():
        raise _invalid(name, value, "an integer")
    if number < minimum:
        raise _invalid(name, value, f"at least {minimum:g}")
    return number


def positive_int(name: str, value: object) -> int:
    return int(_number(name, value, minimum=1, integer=True))


def non_negative_float(name: str, value: object) -> float:
    return float(_number(name, value, minimum=0, integer=False))


def positive_float(name: str, value: object) -> float:
    number = float(_number(name, value, minimum=0, integer=False))
    if number == 0:
        raise _invalid(name, value, "greater than 0")
    return number


def optional_positive_int(name: str, value: object) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in {"", "none"}):
        return None
    return positive_int(name, value)


def optional_str(name: str, value: object) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise _invalid(name, value, "a string")
    return value


MIN_TOKEN_LENGTH = 24


def token(name: str, value: object) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) < MIN_TOKEN_LENGTH or any(c.isspace() for c in value):
        # Never repeated: the value is a secret.
        raise ImproperlyConfigured(
            f"{PREFIX}{name} must be at least {MIN_TOKEN_LENGTH} characters without spaces (a random token)."
        )
    return value


def key_prefix(name: str, value: object) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise _invalid(name, value, "a non-empty string without spaces")
    return value


def secret(name: str, value: object) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise _invalid(name, "***", "a string")
    return value


def keys(name: str, value: object) -> list[str]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _invalid(name, "***", 'a JSON list of keys such as ["old key"]') from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(k, str) and k for k in value):
        raise _invalid(name, "***", "a list of non-empty strings")
    return list(value)


def groups(name: str, value: object) -> dict[str, bool]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _invalid(name, value, 'a JSON object such as {"summaries": true}') from None
    if not isinstance(value, Mapping):
        raise _invalid(name, value, "a mapping of group name to boolean")
    return {str(group): boolean(f"{name}[{group!r}]", switch) for group, switch in value.items()}


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One setting: its name without prefix, how to parse it, its default."""

    name: str
    parse: Callable[[str, object], T]
    default: T
    doc: str

    @property
    def django_name(self) -> str:
        return PREFIX + self.name

    def read(self) -> T:
        value = getattr(django_settings, self.django_name, _MISSING)
        if value is _MISSING:
            value = os.environ.get(self.django_name, _MISSING)
        if value is _MISSING:
            return self.default
        return self.parse(self.name, value)

    @overload
    def __get__(self, instance: None, owner: type) -> Setting[T]: ...
    @overload
    def __get__(self, instance: object, owner: type) -> T: ...
    def __get__(self, instance: object | None, owner: type) -> T | Setting[T]:
        return self if instance is None else self.read()


_MISSING: Any = object()
