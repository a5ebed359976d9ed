"""The driver's handle of a weight-sync group: starts the coordinator as a named Ray actor, and where
every process of the group finds the group's secret.

The secret is the group's only credential: the coordinator answers no call that does not present it.
Ray offers no store that another job of the same cluster cannot read (its internal key-value store, in
any namespace, and the job table with every job's ``runtime_env``, are open to every Ray client;
named actors are reachable from any namespace), so the secret is never put into Ray by weightsync.
It comes, in this order, from:

1. ``secret=`` handed in explicitly (``Group.create``, ``Source``, ``Destination``);
2. a group created by this very process (the process-local copy ``Group.create`` keeps);
3. the ``WEIGHTSYNC_SECRET`` environment variable, which an RL framework sets for all actors of its
   job with ``ray.init(runtime_env={"env_vars": {"WEIGHTSYNC_SECRET": ...}})`` (the driver itself
   reads it from its job's runtime_env first, since that is what the job's actors see). Convenient,
   but Ray records a job's runtime_env in its job table, which any client of the cluster can read:
   see docs/SECURITY.md;
4. nothing: ``Group.create`` makes a fresh random secret that only this process knows (hand it on as
   ``group.secret``); a participant raises an error that says how to share it.

The coordinator never holds the secret itself, only the admission key it checks members' proofs with,
and members never send it the secret (weightsync.control.admission): neither the actor's creation
arguments nor its memory nor anything presented to it gives away the secret or the engines' key.
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import Any

from weightsync.control.admission import admission_key, prove
from weightsync.control.coordinator import Coordinator
from weightsync.control.rendezvous import ensure_ray
from weightsync.errors import LayoutError, PlanError, WeightSyncError
from weightsync.plan.lower import RELAY_CHUNK_BYTES
from weightsync.plan.ops import LOCAL_ROUND_BYTES, ROUND_BYTES

SECRET_ENV = "WEIGHTSYNC_SECRET"
# A secret handed in must carry at least this many characters (a token_hex(16) has 32): the secret is
# the whole of the group's access control, so a short password-like one is refused rather than used.
MIN_SECRET_CHARS = 16

# Secrets of groups created by this process, by (Ray namespace, group name): a Source or Destination
# made in the same process (a notebook, a single-process test) finds its group's secret here.
_local_secrets: dict[tuple[str, str], str] = {}
_local_lock = threading.Lock()


def actor_name(name: str) -> str:
    """The Ray actor name of group ``name``'s coordinator."""
    return f"weightsync:{name}"


def new_secret() -> str:
    """A fresh group secret (128 random bits, hex)."""
    return secrets.token_hex(16)


def _checked(secret: Any, group: str, origin: str) -> str:
    if not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS:
        # Says where the bad secret came from and what is wrong with it, never its value.
        raise WeightSyncError(f"group {group!r}: the secret from {origin} must be a string of at least "
                              f"{MIN_SECRET_CHARS} characters (weightsync.new_secret() "
                              f"makes one)")
    return secret


def _namespace() -> str:
    import ray

    try:
        return ray.get_runtime_context().namespace if ray.is_initialized() else ""
    except Exception:  # no namespace to tell groups of the same name apart: one process, one group
        return ""


def _job_env_secret() -> str | None:
    """WEIGHTSYNC_SECRET of this job's runtime_env: on a driver, runtime_env env_vars reach the job's
    workers but not the driver's own environment."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        env = ray.get_runtime_context().runtime_env.get("env_vars") or {}
    except Exception:  # a runtime context without a runtime_env: nothing set there
        return None
    value = env.get(SECRET_ENV)
    return value if value else None


def resolve_secret(group: str, explicit: str | None) -> str | None:
    """The group's secret as this process knows it (explicit, this process's own group, the
    environment, the job's runtime_env), or None when it knows none."""
    if explicit is not None:
        return _checked(explicit, group, "the secret= argument")
    with _local_lock:
        local = _local_secrets.get((_namespace(), group))
    if local is not None:
        return local
    return _environment_secret(group)


def _environment_secret(group: str) -> str | None:
    """WEIGHTSYNC_SECRET of the job's runtime_env, else of this process's environment. The job's comes
    first: it is the value every actor of the job sees (runtime_env env_vars override what a worker
    inherits), while a driver's own environment may hold another one from its shell."""
    value = _job_env_secret()
    if value:
        return _checked(value, group, f"the job's runtime_env ({SECRET_ENV})")
    value = os.environ.get(SECRET_ENV)
    if value:
        return _checked(value, group, f"the {SECRET_ENV} environment variable")
    return None


def participant_secret(group: str, explicit: str | None) -> str:
    """The secret a Source or Destination joins with; a clear error when this process has none."""
    secret = resolve_secret(group, explicit)
    if secret is None:
        raise WeightSyncError(
            f"group {group!r}: this process does not know the group's secret. Hand it in as "
            f"secret=group.secret, or set {SECRET_ENV} for every process of the job, e.g. ray.init("
            f"runtime_env={{'env_vars': {{'{SECRET_ENV}': weightsync.new_secret()}}}}) on "
            f"the driver before Group.create (see docs/SECURITY.md for who else can read that)")
    return secret


class Group:
    """Driver-side handle of a weight-sync group: owns the named coordinator actor. ``secret`` is the
    group's credential (hand it to participants that cannot read it from their environment); it is
    kept out of the handle's repr."""

    def __init__(self, name: str, actor: Any, secret: str) -> None:
        self.name = name
        self._actor = actor
        self.secret = secret

    def __repr__(self) -> str:
        return f"Group(name={self.name!r})"

    @classmethod
    def create(cls, name: str, num_sources: int, num_destinations: int, *, allow_cast: bool = False,
               fp8_block: tuple[int, int] | None = (128, 128), relay: bool | None = None,
               relay_chunk_bytes: int = RELAY_CHUNK_BYTES, round_bytes: int = ROUND_BYTES,
               local_round_bytes: int = LOCAL_ROUND_BYTES, secret: str | None = None) -> Group:
        """Starts the coordinator as a named actor in the caller's Ray namespace.

        ``secret``: the group's credential; every participant must present it. None: the
        ``WEIGHTSYNC_SECRET`` of this process's environment or of its job's runtime_env, else a fresh
        random one that only this process knows (``group.secret``; participants elsewhere must be
        handed it). See the module's docstring and docs/SECURITY.md.

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

        if num_sources < 1 or num_destinations < 1:
            raise LayoutError(f"group {name!r} needs at least one source and one destination")
        if round_bytes < 1 or local_round_bytes < 1:
            raise PlanError(f"group {name!r}: round_bytes ({round_bytes}) and local_round_bytes "
                            f"({local_round_bytes}) must be at least 1")
        # Connected already, or to the cluster WEIGHTSYNC_RAY_ADDRESS names, else a Ray of its own.
        ensure_ray()
        if secret is not None:
            secret = _checked(secret, name, "the secret= argument")
        else:
            # Not this process's earlier group of the same name: a new group gets the environment's
            # secret or a new one.
            secret = _environment_secret(name) or new_secret()
        # The actor is created with the admission key only: its creation arguments and memory hold no
        # secret and no engine key.
        actor = (
            ray.remote(num_cpus=0, max_concurrency=1024)(Coordinator)
            .options(name=actor_name(name))
            .remote(name, num_sources, num_destinations, None, allow_cast, fp8_block, relay,
                    int(relay_chunk_bytes), int(round_bytes), int(local_round_bytes),
                    admission_key=admission_key(secret, name))
        )
        ray.get(actor.status.remote(prove(admission_key(secret, name), name, "status")))
        with _local_lock:
            _local_secrets[(_namespace(), name)] = secret
        return cls(name, actor, secret)

    def status(self) -> dict[str, Any]:
        """The coordinator's view: plan epoch, member ranks, dead ones, the last planning error, whether
        the plan relays and its chain, the epoch each source's watcher has heard, and the calls refused
        for a wrong secret (per method)."""
        import ray

        return ray.get(self._actor.status.remote(prove(admission_key(self.secret, self.name), self.name,
                                                       "status")))

    def shutdown(self) -> None:
        """Ends the group: forgets this process's copy of its secret and kills the coordinator actor."""
        import ray

        with _local_lock:
            key = (_namespace(), self.name)
            if _local_secrets.get(key) == self.secret:
                del _local_secrets[key]
        ray.kill(self._actor)
