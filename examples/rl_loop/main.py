"""The driver: starts Ray, the weightsync group, trainers and rollouts, and runs the async PPO loop.

Step s (s = 1, 2, ...): the trainers run PPO on a batch and start the push of the result as version s
(``ws.push_async``); the push moves its bytes while step s + 1's forward and backward run, and the
trainers wait for it only before step s + 1's first optimizer step (``wait`` in the progress lines: how
long they actually waited). While they train, the rollouts keep generating with the newest version they
hold and the driver already collects the batch for step s + 1, keeping only samples of version
>= s - max_staleness (the trainers will start step s + 1 from version s). Every rollout checks the weights
it applied for version s against full tensors the trainers gathered over their own process group (while
step s + 1 trains); ``weights_match`` is true only if every rollout matched bit for bit after every push.
The next push starts only after that check, so no rollout skips a version.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import sys
import time
from typing import Any

import torch

from .model import ModelConfig
from .task import DigitSumTask

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.rl_loop", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=150, help="PPO steps, one weight push each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-staleness", type=int, default=1,
                   help="train only on samples at most this many versions older than the trainers' weights")
    p.add_argument("--trainers", type=int, default=2, help="trainer ranks (FSDP2 shards)")
    p.add_argument("--rollouts", type=int, default=2, help="rollout ranks (fused full replicas)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--gpus", type=int, default=0,
                   help="with --device cuda: GPUs to use (default one per actor; with fewer, trainer i and "
                        "rollout j share GPUs i %% gpus and j %% gpus; needs gpus >= trainers)")
    p.add_argument("--mode", choices=["staged", "inplace"], default="staged",
                   help="weightsync destination mode")
    p.add_argument("--prompts", type=int, default=32, help="prompts (groups) per step")
    p.add_argument("--group-size", type=int, default=16, help="answers per prompt (the GRPO group)")
    p.add_argument("--digits", type=int, default=3, help="digits per answer")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=4, help="optimizer steps per batch (one push per batch)")
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip range")
    p.add_argument("--window", type=int, default=10, help="steps averaged for reward_first / reward_last")
    p.add_argument("--plot", default="rl_loop.png", help="where to write the plot ('' for none)")
    p.add_argument("--quiet", action="store_true", help="print only the final JSON line")
    p.add_argument("--delta", action="store_true",
                   help="delta pushes: each push sends only the values that changed since the last (this "
                        "loop's learning rate changes most of them: expect little saving)")
    args = p.parse_args(argv)
    if args.prompts % args.rollouts:
        p.error("--prompts must be a multiple of --rollouts")
    if args.device == "cuda":
        args.gpus = args.gpus or args.trainers + args.rollouts
        if args.gpus < args.trainers:
            p.error("--gpus must be at least --trainers (NCCL wants one GPU per trainer rank)")
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    import weightsync as ws

    from .rollout import Rollout
    from .trainer import Trainer

    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    task = DigitSumTask(args.digits)
    cfg = ModelConfig(vocab_size=task.vocab_size, seq_len=task.seq_len)
    chance = task.chance_reward()
    t_start = time.perf_counter()
    # A Ray instance of our own (address="local"): never join one that other jobs on this machine use.
    actors_n = args.trainers + args.rollouts
    gpus = args.gpus if args.device == "cuda" else 0
    ray.init(address="local", num_cpus=actors_n, num_gpus=gpus, include_dashboard=False,
             log_to_driver=not args.quiet, logging_level="ERROR",
             # Every actor of this job gets the group's secret (docs/SECURITY.md: who else can read it).
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1",
                                       "WEIGHTSYNC_SECRET": secrets.token_hex(16)}})
    name = f"rl_loop-{os.getpid()}"
    actors: list[Any] = []
    group = None
    try:
        group = ws.Group.create(name, num_sources=args.trainers, num_destinations=args.rollouts)
        placement = _gpu_placement(ray, args) if args.device == "cuda" else None
        trainer_cls = ray.remote(num_cpus=1)(Trainer)
        # Threaded actor: take() and verify() block while the generation thread runs.
        rollout_cls = ray.remote(num_cpus=1, max_concurrency=4)(Rollout)
        if placement is not None:
            trainer_cls = [trainer_cls.options(**placement(i)) for i in range(args.trainers)]
            rollout_cls = [rollout_cls.options(**placement(j)) for j in range(args.rollouts)]
        else:
            trainer_cls = [trainer_cls] * args.trainers
            rollout_cls = [rollout_cls] * args.rollouts
        groups_per_rollout = args.prompts // args.rollouts
        gen_groups = max(1, groups_per_rollout // 2)
        rollouts = [rollout_cls[j].remote(name, j, cfg, task, args.seed, gen_groups, args.group_size,
                                          args.mode, args.device, delta=args.delta)
                    for j in range(args.rollouts)]
        port = _free_port()
        trainers = [trainer_cls[i].remote(name, i, args.trainers, port, cfg, task, args.seed, args.lr,
                                          args.clip, args.epochs, args.group_size, args.device,
                                          delta=args.delta)
                    for i in range(args.trainers)]
        actors = trainers + rollouts
        ray.get([a.__ray_ready__.remote() for a in actors], timeout=300)
        setup_s = time.perf_counter() - t_start
        say(f"rl_loop: {args.trainers} trainers (FSDP2 dim-0 shards) -> {args.rollouts} rollouts "
            "(fused qkv/gate_up "
            f"replicas), {args.device}, {args.mode}; digit-sum task with {args.digits} digits, chance reward "
            f"{chance:.3f}; setup {setup_s:.1f} s")

        init = ray.get([t.initial.remote() for t in trainers])
        mismatches = _verify(ray, rollouts, 0, init[0]["reference"])
        checks = len(rollouts)
        pushes = 1
        # The push whose check the next step line reports: version, result per trainer, its check.
        last_push: tuple[int, list[dict[str, Any]], list[str]] = (0, [i["push"] for i in init], mismatches)
        checking: list[Any] | None = None  # the rollouts' check of the push in flight

        # Batch requests run ahead of training by `depth` steps; the samples for step s' must come from
        # version >= s' - 1 - max_staleness (step s' trains from version s' - 1). With max_staleness 0 the
        # request for step s + 1 waits for version s: on-policy, generation and training alternate.
        depth = max(1, args.max_staleness)
        pending: dict[int, list[Any]] = {}
        requested = [0]  # the last step whose batch has been requested

        def request_through(last: int) -> None:
            for s in range(requested[0] + 1, min(last, args.steps) + 1):
                min_version = max(0, s - 1 - args.max_staleness)
                pending[s] = [r.take.remote(s, groups_per_rollout, min_version) for r in rollouts]
                requested[0] = s

        history: list[dict[str, Any]] = []
        request_through(depth)
        for step in range(1, args.steps + 1):
            parts = ray.get(pending.pop(step), timeout=300)
            batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            t_step = time.perf_counter()
            futures = [t.step.remote(step, batch) for t in trainers]
            # While the trainers train (and the last push lands), the rollouts generate the next batches.
            request_through(step + depth)
            results = ray.get(futures, timeout=300)
            if checking is not None:  # the push of step - 1 ended before this step's optimizer steps
                bad = _verify_result(ray, checking, step - 1)
                checks += len(rollouts)
                mismatches += bad
                last_push = (step - 1, [r["push"] for r in results], bad)
            # Start the push of this step's weights; the next step trains while it lands.
            started = ray.get([t.push.remote(step) for t in trainers], timeout=300)
            pushes += 1
            checking = _verify_start(ray, rollouts, step, started[0]["reference"])
            version, push, bad = last_push
            push_s = max(p["seconds"] for p in push)
            push_bytes = sum(p["bytes"] for p in push)
            wire_bytes = sum(p["wire_bytes"] for p in push)
            changed = [p["changed"] for p in push if p["changed"] >= 0]
            wait_s = max(r["wait_s"] for r in results)
            staleness = (step - 1) - batch["versions"]  # trainers trained from version step - 1
            rec = {"step": step, "reward": batch["rewards"].mean().item(),
                   "staleness_mean": staleness.float().mean().item(), "staleness_max": int(staleness.max()),
                   "push_version": version, "push_s": push_s, "push_bytes": push_bytes,
                   "push_gbps": push_bytes / push_s / 1e9, "wait_s": wait_s, "wire_bytes": wire_bytes,
                   "changed_fraction": statistics.fmean(changed) if changed else None,
                   "train_s": max(r["train_s"] for r in results), "step_s": time.perf_counter() - t_step,
                   "clip_frac": results[0]["clip_frac"], "match": not bad}
            history.append(rec)
            say(f"step {step:4d}  reward {rec['reward']:.3f}  staleness {rec['staleness_mean']:.2f} (max "
                f"{rec['staleness_max']})  push v{version} {push_s * 1e3:6.1f} ms "
                f"{rec['push_gbps']:.3f} GB/s, "
                + (f"delta {rec['changed_fraction']:.1%} changed, wire {wire_bytes / 1e6:.2f} of "
                   f"{push_bytes / 1e6:.2f} MB, " if args.delta and rec["changed_fraction"] is not None
                   else "")
                + f"trainer waited {wait_s * 1e3:6.2f} ms  "
                f"train {rec['train_s']:.2f} s  clip {rec['clip_frac']:.2f}  "
                f"v{version} weights {'ok' if not bad else bad}")

        if checking is not None:  # the last push: wait for it and check it
            final = ray.get([t.finish.remote() for t in trainers], timeout=300)
            bad = _verify_result(ray, checking, args.steps)
            checks += len(rollouts)
            mismatches += bad
            push_s = max(f["push"]["seconds"] for f in final)
            say(f"last push v{args.steps} {push_s * 1e3:.1f} ms, trainer waited "
                f"{max(f['wait_s'] for f in final) * 1e3:.2f} ms  v{args.steps} weights "
                f"{'ok' if not bad else bad}")
        infos = ray.get([r.close.remote() for r in rollouts])
        ray.get([t.close.remote() for t in trainers])
        window = max(1, min(args.window, len(history) // 2))
        rewards = [h["reward"] for h in history]
        summary = {
            "steps": len(history),
            "reward_first": round(statistics.fmean(rewards[:window]), 4),
            "reward_last": round(statistics.fmean(rewards[-window:]), 4),
            "reward_window": window,
            "chance_reward": round(chance, 4),
            "pushes": pushes,
            "push_s_median": round(statistics.median(h["push_s"] for h in history), 5),
            # How long the trainers waited for a push before their next optimizer step (the push itself
            # overlaps the next step's forward and backward).
            "wait_s_median": round(statistics.median(h["wait_s"] for h in history), 5),
            "wait_s_max": round(max(h["wait_s"] for h in history), 5),
            "push_gbps_median": round(statistics.median(h["push_gbps"] for h in history), 4),
            "push_bytes": history[0]["push_bytes"] if history else 0,
            "delta": args.delta,
            "wire_bytes_median": statistics.median(h["wire_bytes"] for h in history) if history else 0,
            "weights_match": not mismatches and checks == pushes * len(rollouts),
            "weight_checks": checks,
            "staleness_mean": round(statistics.fmean(h["staleness_mean"] for h in history), 3),
            "staleness_max": max(h["staleness_max"] for h in history),
            "dropped_stale_groups": sum(i["dropped_stale"] for i in infos),
            "discarded_generations": sum(i["discarded_torn"] for i in infos),
            "trainers": args.trainers,
            "rollouts": args.rollouts,
            "device": args.device,
            "gpus": args.gpus,
            # Where weightsync reads and writes: the training/inference tensors themselves, or host mirrors.
            "sync_memory": {"trainers": [i["sync_memory"] for i in init],
                            "rollouts": [i["sync_memory"] for i in infos]},
            "mode": args.mode,
            "max_staleness": args.max_staleness,
            "seed": args.seed,
            "wall_s": round(time.perf_counter() - t_start, 1),
        }
        if mismatches:
            summary["mismatches"] = mismatches[:5]
        if args.plot:
            plot(history, chance, args.plot)
            say(f"wrote {args.plot}")
        return summary
    finally:
        for a in actors:
            ray.kill(a)
        if group is not None:
            group.shutdown()
        ray.shutdown()


def _gpu_placement(ray: Any, args: argparse.Namespace) -> Any:
    """Ray options per actor index: one whole GPU each, or, with fewer GPUs than actors, a share of GPU
    ``index % gpus`` (a placement group bundle per GPU keeps trainer ranks on distinct GPUs)."""
    actors = args.trainers + args.rollouts
    if args.gpus >= actors:
        return lambda index: {"num_gpus": 1}
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    per_gpu = -(-actors // args.gpus)
    pg = placement_group([{"GPU": 1, "CPU": per_gpu}] * args.gpus, strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    return lambda index: {"num_gpus": 1 / per_gpu, "scheduling_strategy": PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=index % args.gpus)}


def _verify(ray: Any, rollouts: list[Any], version: int, reference: dict[str, torch.Tensor]) -> list[str]:
    return _verify_result(ray, _verify_start(ray, rollouts, version, reference), version)


def _verify_start(ray: Any, rollouts: list[Any], version: int,
                  reference: dict[str, torch.Tensor]) -> list[Any]:
    ref = ray.put(reference)  # one copy in the object store for every rollout
    return [r.verify.remote(version, ref) for r in rollouts]


def _verify_result(ray: Any, refs: list[Any], version: int) -> list[str]:
    results = ray.get(refs, timeout=120)
    return [f"rollout {j} version {version}: {m}" for j, bad in enumerate(results) for m in bad]


def plot(history: list[dict[str, Any]], chance: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(steps, [h["reward"] for h in history], label="mean reward of the step's batch")
    ax1.axhline(chance, color="grey", linestyle="--", label=f"chance ({chance:.3f})")
    ax1.set_ylabel("reward")
    ax1.set_ylim(0, 1)
    ax1.legend(loc="upper left")
    ax2.plot(steps, [h["push_s"] * 1e3 for h in history], color="tab:orange", label="push (previous version)")
    ax2.plot(steps, [h["wait_s"] * 1e3 for h in history], color="tab:green", label="trainer's wait for it")
    ax2.set_ylabel("ms")
    ax2.legend(loc="upper right")
    ax2.set_xlabel("step (one push each)")
    fig.suptitle("examples.rl_loop: async PPO, weights pushed by weightsync every step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = run(args)
    print(json.dumps(summary), flush=True)
    return 0 if summary["weights_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
