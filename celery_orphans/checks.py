"""Django system checks (filled in below)."""

from __future__ import annotations


def register() -> None:
    pass
