"""A second Ray job (its own driver process, its own namespace) going after group GROUP of the job in
namespace VICTIM, with everything Ray lets any client of the cluster do. Run as a script:

    python -m tests.security._attacker ADDRESS VICTIM GROUP DUMP_PATH

It writes what it could read (internal KV of several namespaces, the job and actor tables) to
DUMP_PATH, so that the test can look for the secret there, and prints one JSON line: what each
attempt got.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import ray
import torch

import weightsync as ws
from weightsync.control.group import actor_name

GUESSES = ["", "0" * 32, "weightsync", "guess-" + "a" * 26]


def _attempt(fn: Any) -> str:
    """'accepted: <value>' or the error's type and message."""
    try:
        return f"accepted: {fn()!r}"[:200]
    except Exception as exc:  # every refusal is recorded, whatever its type
        cause = getattr(exc, "cause", None) or exc
        return f"{type(cause).__name__}: {cause}"[:300]


def _read_everything(victim: str) -> str:
    """What a curious client can read without the group's cooperation."""
    from ray.experimental import internal_kv

    out = []
    for ns in (None, victim, "attacker", "weightsync", "default"):
        try:
            keys = internal_kv._internal_kv_list(b"", namespace=ns)
        except Exception as exc:  # a namespace this Ray refuses to list: note it and go on
            out.append(f"kv list {ns}: {exc}")
            continue
        for k in keys:
            out.append(f"kv {ns} {k!r} = {internal_kv._internal_kv_get(k, namespace=ns)!r}")
    worker = ray._private.worker.global_worker
    try:
        out.append(f"jobs: {worker.gcs_client.get_all_job_info()!r}")
    except Exception as exc:  # an API that moved between Ray versions
        out.append(f"jobs: {exc}")
    try:
        out.append(f"actors: {ray._private.state.actors()!r}")
    except Exception as exc:  # as above
        out.append(f"actors: {exc}")
    return "\n".join(out)


def main(address: str, victim: str, group: str, dump: str) -> None:
    result: dict[str, Any] = {}
    ray.init(address=address, namespace="attacker", log_to_driver=False)
    with open(dump, "w") as f:
        f.write(_read_everything(victim))
    # Named actors are reachable from any namespace: the coordinator's handle is one call away.
    coord = ray.get_actor(actor_name(group), namespace=victim)
    calls = {
        "status": lambda s: ray.get(coord.status.remote(s), timeout=30),
        "current_epoch": lambda s: ray.get(coord.current_epoch.remote(s), timeout=30),
        "join": lambda s: ray.get(coord.join.remote(s, "source", 0, b"", b"addr", "evil-host",
                                                    {"nics": 1}, {}, b""), timeout=30),
        "part": lambda s: ray.get(coord.part.remote(s, "destination", 0, -1, 1.0), timeout=30),
        "report_dead": lambda s: ray.get(coord.report_dead.remote(s, "destination 1", "destination", [0],
                                                                  10**6), timeout=30),
        "wait_epoch": lambda s: ray.get(coord.wait_epoch.remote(s, 0, "evil", -1, 0.1), timeout=30),
        "publish_receive": lambda s: ray.get(coord.publish_receive.remote(s, 0, 1, b"evil"), timeout=30),
        "receive_buffers": lambda s: ray.get(coord.receive_buffers.remote(s, 1, [0], 0.1), timeout=30),
        "unwatch": lambda s: ray.get(coord.unwatch.remote(s, 0, "evil"), timeout=30),
    }
    result["calls"] = {name: [_attempt(lambda s=s, call=call: call(s)) for s in GUESSES]
                       for name, call in calls.items()}
    ray.shutdown()

    # The namespace is no boundary either: join the victim's and try the public API as source 0.
    ray.init(address=address, namespace=victim, log_to_driver=False)
    w = torch.full((1024,), 666.0)
    result["source_without_secret"] = _attempt(lambda: ws.Source(group, 0, {"w": w}, timeout=10))
    sources = []

    def join_and_push() -> str:
        src = ws.Source(group, 0, {"w": w}, timeout=10, secret=GUESSES[3])
        sources.append(src)
        return repr(ws.push(src, version=2000, timeout=10))

    result["source_with_guess"] = _attempt(join_and_push)
    result["source_short_secret"] = _attempt(lambda: ws.Source(group, 0, {"w": w}, timeout=10, secret="x"))
    print(json.dumps(result), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:5])
