"""How a member proves to its group's coordinator that it knows the group's secret, without handing the
coordinator anything that opens more than the coordinator itself.

Any Ray job of the cluster can run code inside the coordinator (a named actor is reachable from every
namespace, and Ray's built-in ``__ray_call__`` runs any callable on an actor), so whatever a member
presents there, and whatever the coordinator keeps, must be worth no more than the coordinator is. Two
keys come from the secret, each an HMAC keyed by it over its own label (weightsync.control.engine_key
for the other), so neither gives the secret or the other key:

- the *admission key*, which the coordinator keeps to check proofs (checking an HMAC needs its key);
- the *engine key*, which only members' transfer engines hold: it is what lets an engine write into or
  read from another member's engine, and the coordinator never sees it.

A member's call carries a proof, never the secret: an HMAC by the admission key over the group, the
method called, the time and a fresh random nonce. The coordinator takes each nonce once, and only
within ``PROOF_WINDOW_S`` of the time it names, so a proof seen on the way works for nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from typing import Any

ADMISSION_KEY_LABEL = "weightsync admission key v1:"
# How far a proof's time may be from the coordinator's clock (hosts of one cluster keep their clocks
# within this of each other; the engines' connection proofs ask the same of them).
PROOF_WINDOW_S = 30.0

Proof = tuple[float, str, str]  # (unix time it was made, nonce, HMAC as hex)


def admission_key(secret: str, group: str) -> bytes:
    """HMAC-SHA256 keyed by the group secret over a label and the group name (32 bytes)."""
    return hmac.new(secret.encode(), f"{ADMISSION_KEY_LABEL}{group}".encode(), hashlib.sha256).digest()


def _mac(key: bytes, group: str, method: str, made: float, nonce: str) -> str:
    return hmac.new(key, f"{group}\0{method}\0{made!r}\0{nonce}".encode(), hashlib.sha256).hexdigest()


def prove(key: bytes, group: str, method: str) -> Proof:
    """A fresh proof for one call of ``method`` of group ``group``'s coordinator."""
    made = time.time()
    nonce = secrets.token_hex(16)
    return made, nonce, _mac(key, group, method, made, nonce)


class ProofChecker:
    """The coordinator's side: checks a proof's HMAC and freshness and takes each nonce once."""

    def __init__(self, key: bytes, group: str) -> None:
        self._key = key
        self._group = group
        self._seen: dict[str, float] = {}  # nonce -> when it may be forgotten (its time is out of the window)
        self._lock = threading.Lock()
        self._next_prune = 0.0

    def check(self, proof: Any, method: str) -> str | None:
        """None when ``proof`` is a fresh, valid proof for ``method``; else why not (no secret in it)."""
        if not (isinstance(proof, (tuple, list)) and len(proof) == 3 and isinstance(proof[0], float)
                and isinstance(proof[1], str) and isinstance(proof[2], str) and len(proof[1]) <= 64
                and len(proof[2]) <= 64):
            # Still compared, so that a refusal costs about the same whatever came in.
            hmac.compare_digest(_mac(self._key, self._group, method, 0.0, ""), "")
            return "wrong secret"
        made, nonce, mac = proof
        if not hmac.compare_digest(_mac(self._key, self._group, method, made, nonce), mac):
            return "wrong secret"
        now = time.time()
        if abs(now - made) > PROOF_WINDOW_S:
            return f"a proof made {now - made:+.0f} s from now (clocks more than {PROOF_WINDOW_S:g} s apart?)"
        with self._lock:
            if nonce in self._seen:
                return "a proof presented before"
            # Only valid proofs are kept, so only members grow this; proofs that aged out are dropped
            # once a second, not on every call.
            if now >= self._next_prune:
                self._next_prune = now + 1.0
                for old in [n for n, until in self._seen.items() if until < now]:
                    del self._seen[old]
            self._seen[nonce] = made + 2 * PROOF_WINDOW_S
        return None
