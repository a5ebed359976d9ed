"""Rollout ranks: Ray actors that generate continuously from their own fused weights.

Each rollout is a full replica in the inference layout (``qkv_proj``/``gate_up_proj`` fused, see
``model.py``), a layout different from the trainers' dim-0 shards of unfused tensors; weightsync's plan
maps one onto the other. A generation thread loops:

1. *safe point*: ``dst.apply()`` (staged mode) makes the newest complete version live between two
   generations; the weights a generation reads never change under it. After a new version is applied,
   the live weights are snapshotted for the trainers' check (``verify``).
2. generate ``gen_groups`` prompts x ``group_size`` answers with version v and tag every sample with v;
3. put the groups into a buffer that serves the driver's ``take`` requests in order.

Generation is demand-driven: the thread generates only while queued requests that the live version may
serve (``min_version <= live version``) want more groups than are buffered. Samples nobody can train on
are never made (on 2 CPU cores they would only slow the trainers down), and the thread keeps visiting
safe points while it idles. How far generation runs ahead of training is set by how many requests the
driver keeps queued, which it derives from ``--max-staleness``.

``inplace`` mode receives straight into the live tensors. The rollout then generates optimistically and
throws a generation away if an update was landing or a new version completed while it ran. That check
is best effort: ``dst.updating`` turns true only once the destination's thread has seen an announce, and
bytes of the next version may land before that (writes are unordered), so a generation that ends while
a push is half-landed can keep samples read from mixed weights. Hence ``staged`` is the default.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch

import weightsync as ws

from .model import ModelConfig, fuse, fused_parts, generate
from .task import DigitSumTask


def compare(live: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
            previous: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Names of tensors that are not bit-identical to the reference (missing ones included), with the
    rows that differ and whether those rows hold the previous version instead (a stale or torn update)."""
    bad = [k for k in reference if k not in live]
    for key, want in reference.items():
        got = live.get(key)
        if got is None or (got.shape == want.shape and torch.equal(got.cpu(), want.cpu())):
            continue
        if got.shape != want.shape:
            bad.append(f"{key} (shape {tuple(got.shape)}, want {tuple(want.shape)})")
            continue
        got, want = got.cpu(), want.cpu()
        rows = (got != want).reshape(got.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
        what = f"{key}: rows {_spans(rows)} of {got.shape[0]} differ, max abs diff " \
               f"{(got - want).abs().max().item():.3g}"
        if previous is not None and key in previous:
            stale = torch.equal(got[rows], previous[key].cpu()[rows])
            what += f"; those rows equal the previous version: {stale}"
        bad.append(what)
    return bad


def _spans(rows: list[int]) -> str:
    spans: list[list[int]] = []
    for r in rows:
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


class Rollout:
    def __init__(self, group: str, rank: int, cfg: ModelConfig, task: DigitSumTask, seed: int,
                 gen_groups: int, group_size: int, mode: str, device: str, delta: bool = False) -> None:
        torch.set_num_threads(1)
        self.cfg, self.task, self.rank, self.mode = cfg, task, rank, mode
        self.gen_groups, self.group_size = gen_groups, group_size
        self.device = torch.device("cuda" if device == "cuda" else "cpu")
        self.generator = torch.Generator().manual_seed(seed * 1000 + rank)
        shapes = {k: v.shape for k, v in fuse(cfg, _trainer_shapes(cfg)).items()}
        # The weights generation reads. weightsync writes straight into them (or into their staged shadows)
        # where the engine can register their memory; on a GPU without the engine's cuda lane it writes
        # into host copies instead, which the safe point copies to the GPU.
        self.weights = {k: torch.zeros(shape, device=self.device) for k, shape in shapes.items()}
        self.host = self.weights
        try:
            self.dst = ws.Destination(group, rank=rank, tensors=self._named(self.weights), mode=mode,
                                      delta_bytes=self._inbox(delta))
        except ws.TransportError:
            if self.device.type == "cpu":
                raise
            self.host = {k: torch.zeros(shape) for k, shape in shapes.items()}
            self.dst = ws.Destination(group, rank=rank, tensors=self._named(self.host), mode=mode,
                                      delta_bytes=self._inbox(delta))
        self.live_version = -1
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.previous: dict[str, torch.Tensor] | None = None  # the last reference, to diagnose mismatches
        self.buffer: deque[dict[str, Any]] = deque()
        # Queued take() requests, served strictly in the order the driver issued them (by ticket).
        self.requests: deque[tuple[int, int, int]] = deque()  # (ticket, groups, min_version)
        self.cond = threading.Condition()
        self.stats = {"generated_groups": 0, "dropped_stale": 0, "discarded_torn": 0, "generations": 0}
        self.stop = threading.Event()
        self.error: str | None = None
        self.thread = threading.Thread(target=self._loop, name=f"rollout-{rank}", daemon=True)
        self.thread.start()

    def _inbox(self, delta: bool) -> int:
        """The delta inbox (``--delta``): as large as the weights, since this loop's learning rate changes
        most values every step (writes whose changes do not fit, or are not worth encoding, go dense)."""
        return sum(t.numel() * t.element_size() for t in self.weights.values()) if delta else 0

    def _named(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """What this rollout tells weightsync it holds: fused tensors as ``ws.Fused`` of full-row boxes of
        the trainers' logical tensors, the rest as whole tensors under the trainers' names."""
        named: dict[str, Any] = dict(tensors)
        for layer in range(self.cfg.layers):
            for key, parts in fused_parts(self.cfg, layer).items():
                cols = tensors[key].shape[1]
                named[key] = ws.Fused(tensors[key], 0, [(name, (0, 0), (rows, cols)) for name, rows in parts])
        return named

    # -- the generation thread -----------------------------------------------------------------------
    def _safe_point(self) -> None:
        version = self.dst.apply() if self.mode == "staged" else self.dst.version
        if version == self.live_version or version < 0:
            return
        if self.weights is not self.host:
            for key, t in self.weights.items():
                t.copy_(self.host[key], non_blocking=False)
        with self.cond:
            self.live_version = version
            # What generation reads from now on, kept until the trainers' reference has been compared.
            self.snapshots[version] = {k: t.detach().to("cpu", copy=True) for k, t in self.weights.items()}
            self.cond.notify_all()

    def _wanted(self) -> int:
        """Groups the live version should still generate for the queued requests (lock held)."""
        if not self.requests:
            return 0
        self._drop_older_than(self.requests[0][2])
        servable = sum(n for _, n, min_version in self.requests if min_version <= self.live_version)
        return servable - len(self.buffer)

    def _drop_older_than(self, min_version: int) -> None:
        kept = [g for g in self.buffer if g["version"] >= min_version]
        self.stats["dropped_stale"] += len(self.buffer) - len(kept)
        self.buffer = deque(kept)

    def _loop(self) -> None:
        try:
            while not self.stop.is_set():
                self._safe_point()
                with self.cond:
                    wanted = self._wanted() if self.live_version >= 0 else 0
                    if wanted <= 0:
                        self.cond.wait(0.02)
                        continue
                version = self.live_version
                groups = min(wanted, self.gen_groups)
                if self.mode == "inplace" and self.dst.updating:
                    continue
                targets = self.task.sample_targets(groups, self.generator)
                targets = targets.repeat_interleave(self.group_size).to(self.device)
                tokens, logprobs = generate(self.cfg, self.weights, self.task.prompts(targets),
                                            self.task.num_digits, self.generator)
                if self.mode == "inplace" and (self.dst.updating or self.dst.version != version):
                    self.stats["discarded_torn"] += 1  # the weights may have changed while it ran
                    continue
                rewards = self.task.reward(targets, tokens[:, self.task.prompt_len:])
                with self.cond:
                    for g in range(groups):
                        rows = slice(g * self.group_size, (g + 1) * self.group_size)
                        self.buffer.append({"tokens": tokens[rows].cpu(), "logprobs": logprobs[rows].cpu(),
                                            "rewards": rewards[rows].cpu(), "version": version})
                    self.stats["generated_groups"] += groups
                    self.stats["generations"] += 1
                    self.cond.notify_all()
        except Exception as exc:  # surfaced to the driver by take()/verify()
            self.error = f"rollout {self.rank}: {type(exc).__name__}: {exc}"
            with self.cond:
                self.cond.notify_all()

    # -- called by the driver --------------------------------------------------------------------------
    def take(self, ticket: int, groups: int, min_version: int, timeout: float = 120.0) -> dict[str, Any]:
        """Blocks until it is request ``ticket``'s turn and ``groups`` groups of version >= ``min_version``
        are buffered; returns them. Tickets count 0, 1, 2, ... in the order the driver needs batches."""
        deadline = time.monotonic() + timeout
        with self.cond:
            self.requests.append((ticket, groups, min_version))
            self.requests = deque(sorted(self.requests))
            self.cond.notify_all()
            while True:
                if self.error:
                    raise RuntimeError(self.error)
                if self.requests[0][0] == ticket:
                    self._drop_older_than(min_version)
                    if len(self.buffer) >= groups:
                        break
                left = deadline - time.monotonic()
                if left <= 0:
                    self.requests = deque(r for r in self.requests if r[0] != ticket)
                    raise TimeoutError(f"rollout {self.rank}: request {ticket}: {len(self.buffer)}/{groups} "
                                       f"groups of version >= {min_version} after {timeout} s "
                                       f"(live {self.live_version})")
                self.cond.wait(min(left, 0.5))
            batch = [self.buffer.popleft() for _ in range(groups)]
            self.requests.popleft()
            self.cond.notify_all()
        return {
            "tokens": torch.cat([g["tokens"] for g in batch]),
            "logprobs": torch.cat([g["logprobs"] for g in batch]),
            "rewards": torch.cat([g["rewards"] for g in batch]),
            "versions": torch.tensor([g["version"] for g in batch for _ in range(self.group_size)]),
        }

    def verify(self, version: int, reference: dict[str, torch.Tensor], timeout: float = 60.0) -> list[str]:
        """Compares the weights this rollout generated with at ``version`` to the trainers' full tensors.

        Returns the mismatching tensor names (empty: bit-identical). Waits for the generation thread to
        reach the safe point that applies ``version``; the driver pushes nothing newer before this returns,
        so no version is skipped.
        """
        deadline = time.monotonic() + timeout
        with self.cond:
            while version not in self.snapshots:
                if self.error:
                    raise RuntimeError(self.error)
                left = deadline - time.monotonic()
                if left <= 0:
                    return [f"version {version} never applied (live {self.live_version}, received "
                            f"{self.dst.version}) within {timeout} s"]
                self.cond.wait(min(left, 0.5))
            live = self.snapshots.pop(version)
            for old in [v for v in self.snapshots if v < version]:
                del self.snapshots[old]
        want = fuse(self.cfg, reference)
        bad = compare(live, want, self.previous)
        self.previous = want
        return bad

    def info(self) -> dict[str, Any]:
        with self.cond:
            return {**self.stats, "live_version": self.live_version, "buffered": len(self.buffer),
                    "sync_memory": "host mirror" if self.host is not self.weights else self.device.type}

    def close(self) -> dict[str, Any]:
        self.stop.set()
        self.thread.join(10)
        self.dst.close()
        return self.info()


def _trainer_shapes(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Placeholder full tensors with the trainer's names and shapes (only their shapes are used)."""
    from .model import Policy

    with torch.device("meta"):
        policy = Policy(cfg)
    return {k: torch.empty(v.shape) for k, v in policy.state_dict().items()}
