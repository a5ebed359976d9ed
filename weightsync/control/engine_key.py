"""The engine key: what a participant's transfer engine proves when it connects to another member's
engine (docs/SECURITY.md, docs/design/engine_auth.md). Derived from the group secret so that every
member has it without another exchange, and one-way, so that the engine (and anything that reads its
memory or its configuration) never holds the secret itself, which also opens the coordinator."""

from __future__ import annotations

import hashlib
import hmac

ENGINE_KEY_LABEL = "weightsync engine key v1:"


def engine_key(secret: str, group: str) -> bytes:
    """HMAC-SHA256 keyed by the group secret over a label and the group name (32 bytes): a different key
    per group for one secret, and nothing about the secret learnt from it."""
    return hmac.new(secret.encode(), f"{ENGINE_KEY_LABEL}{group}".encode(), hashlib.sha256).digest()
