"""The Lua the ledger runs inside Redis: each step that must see and change several keys at once.

Every script works on keys under one prefix (``celery_orphans.store.Keys``); the ledger (``ledger.py``)
names the keys and reads the answers. A delivery's entry (``delivery``), the sweep's loads and claims
(``claims``), the workers' leases (``leases``) and their presence (``presence``).
"""

from __future__ import annotations

from celery_orphans.scripts.claims import CLAIM, CLAIM_SECONDS, LIFT, LOAD, UNCLAIM, ClaimMode
from celery_orphans.scripts.delivery import ADMIT, ADMIT_SHA, HAND_BACK, RELEASE, RELEASE_MANY, STALE
from celery_orphans.scripts.leases import CLAIM_LAPSED, EXITED, RENEW
from celery_orphans.scripts.presence import PRESENCE, PRESENCE_LOST

__all__ = [
    "ADMIT",
    "ADMIT_SHA",
    "CLAIM",
    "CLAIM_LAPSED",
    "CLAIM_SECONDS",
    "EXITED",
    "HAND_BACK",
    "LIFT",
    "LOAD",
    "PRESENCE",
    "PRESENCE_LOST",
    "RELEASE",
    "RELEASE_MANY",
    "RENEW",
    "STALE",
    "UNCLAIM",
    "ClaimMode",
]
