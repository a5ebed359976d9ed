"""The cluster's internal key-value store, for integrations whose engine gives them no reply channel of
their own (SGLang's custom weight loader returns nothing to its caller). This room is the only one that
imports Ray; any job of the cluster can read and write this store, so nothing secret goes in it."""

from __future__ import annotations


def put(key: str, value: bytes, namespace: str) -> None:
    """Stores ``value`` under ``key``, replacing what was there."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value, overwrite=True, namespace=namespace)


def take(key: str, namespace: str) -> bytes | None:
    """The value under ``key``, removed from the store; None where there is none yet."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(key, namespace=namespace)
    if raw is not None:
        internal_kv._internal_kv_del(key, namespace=namespace)
    return raw
