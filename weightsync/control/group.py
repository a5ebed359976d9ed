"""The driver's handle of a weight-sync group: starts the coordinator as a named Ray actor and shares the
group's secret through Ray's internal key-value store (members of this Ray cluster can join, others
cannot)."""

from __future__ import annotations

import secrets
from typing import Any

from weightsync.control.coordinator import Coordinator
from weightsync.errors import LayoutError, PlanError
from weightsync.plan.lower import RELAY_CHUNK_BYTES
from weightsync.plan.ops import LOCAL_ROUND_BYTES, ROUND_BYTES


def actor_name(name: str) -> str:
    """The Ray actor name of group ``name``'s coordinator."""
    return f"weightsync:{name}"


def secret_key(name: str) -> bytes:
    """Where group ``name``'s secret lives in Ray's internal key-value store."""
    return f"weightsync/{name}/secret".encode()


class Group:
    """Driver-side handle of a weight-sync group: owns the named coordinator actor."""

    def __init__(self, name: str, actor: Any, secret: str) -> None:
        self.name = name
        self._actor = actor
        self.secret = secret

    @classmethod
    def create(cls, name: str, num_sources: int, num_destinations: int, *, allow_cast: bool = False,
               fp8_block: tuple[int, int] | None = (128, 128), relay: bool | None = None,
               relay_chunk_bytes: int = RELAY_CHUNK_BYTES, round_bytes: int = ROUND_BYTES,
               local_round_bytes: int = LOCAL_ROUND_BYTES) -> Group:
        """Starts the coordinator as a named actor in the caller's Ray namespace.

        Destinations say what they want by the dtype of their tensors. ``fp8_block``: a destination
        tensor in ``float8_e4m3fn`` with a float32 ``<name>_scale_inv`` beside it receives FP8 block
        quantization with these tiles (None refuses FP8 destinations). ``allow_cast``: a destination
        may hold another float dtype than the sources (fp32 to bf16, bf16 to fp16, ...), cast on the
        sender; off by default so that an accidental dtype difference is an error.

        ``relay`` (fan-out): the sources write only into the first destination (the chain's head) and
        every destination's engine forwards each chunk (a write of at most ``relay_chunk_bytes``) to the
        next destination as soon as that chunk has landed, from the engine's own thread, so every link
        carries the model about once. None (default): relay when destinations outnumber sources and
        all destinations hold identical layouts (full replicas); True: whenever the layouts are
        identical; False: never. ``status()["relay"]`` and ``["chain"]`` say what the current plan does.

        ``round_bytes`` / ``local_round_bytes``: how much a source writes into one destination before it
        moves on to the next, over NICs / between GPUs of one host (see :func:`weightsync.plan.plan`)."""
        import ray
        from ray.experimental import internal_kv

        if num_sources < 1 or num_destinations < 1:
            raise LayoutError(f"group {name!r} needs at least one source and one destination")
        if round_bytes < 1 or local_round_bytes < 1:
            raise PlanError(f"group {name!r}: round_bytes ({round_bytes}) and local_round_bytes "
                            f"({local_round_bytes}) must be at least 1")
        if not ray.is_initialized():
            ray.init()
        secret = secrets.token_hex(16)
        actor = (
            ray.remote(num_cpus=0, max_concurrency=1024)(Coordinator)
            .options(name=actor_name(name))
            .remote(name, num_sources, num_destinations, secret, allow_cast, fp8_block, relay,
                    int(relay_chunk_bytes), int(round_bytes), int(local_round_bytes))
        )
        ray.get(actor.current_epoch.remote())
        # The secret travels through Ray's own store: members of this Ray cluster can join, others not.
        internal_kv._internal_kv_put(secret_key(name), secret.encode(), overwrite=True)
        return cls(name, actor, secret)

    def status(self) -> dict[str, Any]:
        """The coordinator's view: plan epoch, member ranks, dead ones, the last planning error, whether
        the plan relays and its chain, and the epoch each source's watcher has heard."""
        import ray

        return ray.get(self._actor.status.remote())

    def shutdown(self) -> None:
        """Ends the group: forgets its secret and kills the coordinator actor."""
        import ray
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(secret_key(self.name))
        ray.kill(self._actor)
