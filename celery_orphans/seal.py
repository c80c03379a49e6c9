"""What seals and opens ledger entries: an HMAC-SHA256 tag over the entry's exact JSON
(``django.core.signing``, salted), keyed by ``CELERY_ORPHANS_SIGNING_KEY`` or Django's ``SECRET_KEY``, with
their fallback keys for rotation (``entry.py`` says what a tag that does not match means).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings as django_settings
from django.core import signing
from django.utils.crypto import salted_hmac
from django.utils.encoding import force_bytes

from celery_orphans.conf import settings

# Salts the signing key, so a tag made for anything else Django signs with the same key never matches.
SALT = "celery_orphans.ledger.entry"


def signer() -> signing.Signer:
    """What seals and opens entries: ``SIGNING_KEY`` and its fallbacks, else ``SECRET_KEY`` and its.

    It reads the settings when it is built: a reader of many entries builds one and opens them all with
    it (``parse``), rather than read the settings once per entry."""
    key = settings.SIGNING_KEY
    fallbacks: list[bytes | str] = [*settings.SIGNING_KEY_FALLBACKS]
    if key is None:
        key = django_settings.SECRET_KEY
        fallbacks += getattr(django_settings, "SECRET_KEY_FALLBACKS", [])
    return _Signer(key=key, fallback_keys=fallbacks, salt=SALT)


class _Signer(signing.Signer):
    """Django's ``Signer``, tags and checks unchanged, that derives each key's HMAC key once, not once per
    tag: every entry's tag is still computed and compared (in constant time, by ``unsign``)."""

    def __init__(self, *, key: bytes | str, fallback_keys: list[bytes | str], salt: str) -> None:
        super().__init__(key=key, fallback_keys=fallback_keys, salt=salt, algorithm="sha256")
        self._key_salt = salt + "signer"  # as Signer.signature salts it
        self._macs: dict[bytes | str, Any] = {}

    def signature(self, value: bytes | str, key: bytes | str | None = None) -> str:
        key = key or self.key
        mac = self._macs.get(key)
        if mac is None:
            # salted_hmac over no message: the derived key's HMAC state, copied for each tag.
            mac = self._macs[key] = salted_hmac(self._key_salt, b"", key, algorithm="sha256")
        mac = mac.copy()
        mac.update(force_bytes(value))
        return signing.b64_encode(mac.digest()).decode()
