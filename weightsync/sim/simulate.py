"""Cost model and flow-level simulation of a push, driven by the same plans the coordinator computes.

Model (all figures per GPU):

- every GPU has ``nics_per_gpu`` NICs of ``nic_gbps`` Gbit/s (one-sided writes between hosts) and an
  NVLink port of ``nvlink_gbs`` GB/s (writes and gathers inside a host);
- a source runs its rounds in order (the plan's schedule), one destination per round; a round is one
  flow, and the source keeps ``window`` rounds in flight (the engine posts the next rounds' writes
  while earlier ones are on the wire). Sender egress and receiver ingress are shared max-min fairly
  among the flows in flight (time-stepped progressive filling; ``window=1`` runs an exact
  event-driven simulation with one flow per sender). With one flow per sender, small timing noise
  makes senders bunch up on destinations and leave others idle; a window of a few rounds absorbs it;
- every write costs ``msg_overhead_us`` of link time on top of its bytes;
- transforms run on the sender before the write and overlap the previous round's write (a pipeline
  with staging): FP8 needs the rows of every tile the sender owns but does not hold gathered first
  (``Plan.gathers``, over NVLink inside the node, before the sender's first quantization, as the
  executor waits for all of them), then quantization at ``quant_gbs`` GB/s of source bytes.

Delta pushes (``changed_fraction`` set; weightsync/delta/): every write carries only its
changed elements, encoded as the smaller of 16-bit block indices (``2 + e`` bytes per change for
elements of ``e`` bytes) and a bitmap (``1/8`` byte per element plus ``e`` per change), never more than
the write; each source first compares and encodes what it sends at ``encode_gbs`` GB/s (of the bytes it
sends, each block once however many destinations take it),
and each destination scatters the changes at ``apply_gbs`` GB/s of the bytes it receives (after its last
write: added to the simulated time).

Checked against a push through the real runtime over emulated hosts (scripts/emulated_cluster.py), three
corrections, off by default so the
cluster-scale figures keep their model:

- ``striping="engine"``: a GPU's NICs are separate ports, and each write lands on them as the engine
  places it: a write (or a 2-D write's row) up to ``stripe_threshold`` whole on the
  NIC with the fewest of that destination's bytes placed on it and not finished, a longer one cut into
  equal pieces over all NICs. With few writes of about the threshold a destination's NICs still get
  unequal shares (three 1 MiB writes: 2 MiB on one NIC, 1 MiB on the other) and the busiest NIC, not
  the GPU's total bandwidth, sets the time;
- ``wire_efficiency``: the payload's share of a link's rate (TCP/IPv4 over Ethernet at MTU 1500 with
  timestamps: 1448 of every 1514 bytes);
- ``push_overhead_s``: what a push costs besides its writes (the grant round trip before them, the
  tails and acks after the last landing), added once.

The lower bound is the slowest link: max over GPUs of bytes through its NIC(s) (in or out) over NIC
bandwidth, and of bytes through its NVLink port (writes and gathers, in or out) over NVLink bandwidth.
No torch needed.
"""

from __future__ import annotations

import heapq
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from weightsync.plan.layout import DTYPE_SIZES
from weightsync.plan.ops import T_CAST, T_FP8, T_SCALE, Plan
from weightsync.plan.planner import plan


@dataclass
class CostModel:
    nic_gbps: float = 400.0        # Gbit/s per NIC
    nics_per_gpu: int = 1
    nvlink_gbs: float = 400.0      # GB/s per GPU, inside a host
    msg_overhead_us: float = 2.0   # link time per write besides its bytes
    quant_gbs: float = 1500.0      # GB/s of source-dtype bytes one GPU quantizes or casts
    window: int = 4                # rounds a source keeps in flight (the engine's pipelining depth)
    pace: bool = False             # hold each round until its planned start (Plan op not_before) ...
    pace_lead: float = 0.0         # ... less this fraction of the planned push
    changed_fraction: float | None = None  # delta pushes: elements changed since the last push (None: dense)
    encode_gbs: float = 1000.0     # delta: GB/s of sent (dense) bytes one source GPU compares and encodes
    apply_gbs: float = 1000.0      # delta: GB/s of received (dense) bytes one destination GPU applies
    # What the emulated cluster (scripts/emulated_cluster.py) showed real ports do; the defaults keep
    # the ideal model of the cluster-scale figures.
    striping: str = "ideal"        # "ideal": a GPU's NICs are one port; "engine": each NIC its own port,
    stripe_threshold: int = 1 << 20  # ... every write cut into the engine's pieces (a write up to this
    max_piece: int = 16 << 20      # ... stays whole), each piece on the least loaded NIC
    wire_efficiency: float = 1.0   # payload share of a link's rate (TCP/IPv4 over Ethernet: 1448/1514)
    push_overhead_s: float = 0.0   # per push: grant round trip before the writes, acks after them

    @property
    def nic_bps(self) -> float:
        return self.nic_gbps * 1e9 / 8 * self.nics_per_gpu * self.wire_efficiency

    @property
    def nvlink_bps(self) -> float:
        return self.nvlink_gbs * 1e9


@dataclass
class SimResult:
    bound_s: float
    sim_s: float
    ratio: float
    bytes_total: int
    bytes_out: np.ndarray      # per source, written (NIC + NVLink)
    bytes_in: np.ndarray       # per destination
    writes_out: np.ndarray     # per source
    gather_bytes: int
    gather_s_max: float
    quant_s_max: float
    flows: int
    encode_s_max: float = 0.0  # delta pushes: the slowest source's compare and encode
    apply_s_max: float = 0.0   # delta pushes: the slowest destination's scatter of the changes
    nic_bytes_in: np.ndarray | None = None  # striping "engine": bytes per destination and NIC

    def summary(self) -> dict[str, Any]:
        def st(a: np.ndarray) -> dict[str, float]:
            a = a.astype(np.float64)
            mean = float(a.mean()) if len(a) else 0.0
            return {"min": float(a.min()) if len(a) else 0.0, "mean": mean,
                    "max": float(a.max()) if len(a) else 0.0,
                    "imbalance": float(a.max() / mean) if mean else 0.0}
        return {"bound_s": self.bound_s, "sim_s": self.sim_s, "ratio": self.ratio,
                "bytes_total": self.bytes_total, "bytes_out_per_trainer": st(self.bytes_out),
                "bytes_in_per_inference_gpu": st(self.bytes_in), "writes_per_trainer": st(self.writes_out),
                "gather_bytes": self.gather_bytes, "gather_s_max": self.gather_s_max,
                "quant_s_max": self.quant_s_max, "flows": self.flows, "encode_s_max": self.encode_s_max,
                "apply_s_max": self.apply_s_max}


def simulate(p: Plan, source_hosts: Sequence[int], destination_hosts: Sequence[int],
             cost: CostModel | None = None) -> SimResult:
    cost = cost or CostModel()
    T, R = p.num_sources, p.num_destinations
    sh = np.asarray(source_hosts, np.int64)
    dh = np.asarray(destination_hosts, np.int64)
    ops = p.ops
    nbytes = (ops["rows"] * ops["row_bytes"]).astype(np.float64)
    src, dst = ops["src_rank"].astype(np.int64), ops["dst_rank"].astype(np.int64)
    local = sh[src] == dh[dst]
    # source bytes a transform reads (quantization/cast work), per op
    tr = ops["transform"]
    ratio = np.ones(len(ops))
    if len(ops):
        src_isz = np.array([DTYPE_SIZES[d] for d in p.src_dtype], np.float64)
        dst_isz = np.array([DTYPE_SIZES[d] for d in p.dst_dtype], np.float64)
        ratio = src_isz[ops["tensor"]] / dst_isz[ops["tensor"]]
    work = np.where(tr == T_CAST, nbytes * ratio, 0.0)
    # FP8: the sender quantizes each tile it owns once, however many destinations take it (replicas
    # share the quantization; see weightsync.plan.writes): a source's quantization work is the source bytes of
    # the boxes its FP8 ops read, spread over those ops by their bytes.
    fp8 = np.flatnonzero(tr == T_FP8)
    if len(fp8) and len(p.boxes):
        pos = np.searchsorted(p.boxes["id"], ops["src_key"][fp8])
        box_bytes = (np.prod(p.boxes["own_shape"].astype(np.float64), axis=1)
                     * np.array([DTYPE_SIZES[p.src_dtype[int(t)]] for t in p.boxes["tensor"]], np.float64))
        pair = np.unique(np.stack([src[fp8], pos], axis=1), axis=0)
        src_work = np.bincount(pair[:, 0], weights=box_bytes[pair[:, 1]], minlength=T)
        src_fp8 = np.bincount(src[fp8], weights=nbytes[fp8], minlength=T)
        work[fp8] = src_work[src[fp8]] * nbytes[fp8] / np.maximum(src_fp8[src[fp8]], 1e-300)
    # Delta pushes: the bytes on the wire, and the encode before / the apply after the writes.
    dense_bytes = nbytes
    encode_s = np.zeros(T)
    apply_s = np.zeros(R)
    if cost.changed_fraction is not None and len(ops):
        es = np.array([DTYPE_SIZES[d] for d in p.dst_dtype], np.float64)[ops["tensor"]]
        es = np.where(tr == T_SCALE, 4.0, es)
        nbytes = nbytes * delta_wire_ratio(cost.changed_fraction, es)
        # a source compares what it holds once, however many destinations take it (replicas)
        cols = ("src_key", "src_offset", "rows", "row_bytes")
        held = np.stack([src] + [ops[c].astype(np.int64) for c in cols], 1)
        _, first = np.unique(held, axis=0, return_index=True)
        encode_s = np.bincount(src[first], weights=dense_bytes[first], minlength=T) / (cost.encode_gbs * 1e9)
        apply_s = np.bincount(dst, weights=dense_bytes, minlength=R) / (cost.apply_gbs * 1e9)
    # flows: runs of equal (source, round, destination); ops are sorted by (source, round) and
    # grouped by destination inside a round
    key = (src << 42) + (ops["round"].astype(np.int64) << 21) + dst
    start = np.ones(len(ops), bool)
    start[1:] = key[1:] != key[:-1]
    fid = np.cumsum(start) - 1
    nf = int(fid[-1]) + 1 if len(ops) else 0
    f_src = src[start]
    f_dst = dst[start]
    f_local = local[start]
    f_bytes = np.bincount(fid, weights=nbytes, minlength=nf)
    f_count = np.bincount(fid, minlength=nf).astype(np.float64)
    f_work = np.bincount(fid, weights=work, minlength=nf)
    bw_nic, bw_nv = cost.nic_bps, cost.nvlink_bps
    f_bw = np.where(f_local, bw_nv, bw_nic)
    # Posting a write costs the sender msg_overhead_us: it lowers the rate the sender can reach on
    # this flow, not the receiver's bandwidth (writes of other senders overlap it there).
    f_cap = f_bw * f_bytes / (f_bytes + f_count * cost.msg_overhead_us * 1e-6 * f_bw)
    # gathers (before the first quantization of a sender): NVLink in a host, NIC across
    g = p.gathers
    g_in = np.zeros(T)
    g_out = np.zeros(T)
    g_nv_in = np.zeros(T)
    g_nv_out = np.zeros(T)
    if len(g):
        same = sh[g["provider"]] == sh[g["gatherer"]]
        gb = g["nbytes"].astype(np.float64)
        np.add.at(g_nv_in, g["gatherer"][same], gb[same])
        np.add.at(g_nv_out, g["provider"][same], gb[same])
        np.add.at(g_in, g["gatherer"][~same], gb[~same])
        np.add.at(g_out, g["provider"][~same], gb[~same])
    # As the sender runs (weightsync.runtime.staging): every provider sends its gathers first, and a
    # gatherer quantizes its first tile only once all of its gathered rows have arrived; writes that need
    # no quantization go ahead meanwhile. So the gathers (NVLink in a host, NIC across) are a phase
    # before the source's first transformed flow.
    gather_s = np.maximum(g_nv_in, g_nv_out) / bw_nv
    gather_nic_s = (g_in + g_out) / bw_nic
    # Preparation pipeline per source: the tiles of flow k are quantized while flow k-1 is on the wire.
    prep = f_work / (cost.quant_gbs * 1e9)
    ready = np.zeros(nf)
    if nf:
        first_of_src = np.ones(nf, bool)
        first_of_src[1:] = f_src[1:] != f_src[:-1]
        csum = np.cumsum(prep)
        base = np.maximum.accumulate(np.where(first_of_src, csum - prep, 0.0))
        w_csum = np.cumsum(f_work)
        w_base = np.maximum.accumulate(np.where(first_of_src, w_csum - f_work, 0.0))
        after_first_transform = (w_csum - w_base) > 0
        ready = csum - base + np.where(after_first_transform, gather_s[f_src] + gather_nic_s[f_src], 0.0)
        ready += encode_s[f_src]
    # Rounds are paced: a round starts no earlier than its not_before fraction of the planned push
    # duration (the largest destination's bytes at its link speed).
    if cost.pace and len(ops):
        horizon = float(p.stats.get("dest_bytes_max", 0) or 0) / bw_nic
        nbf = ops["not_before"][start].astype(np.float64) - cost.pace_lead
        ready = np.maximum(ready, nbf * horizon)
    nic_in = np.zeros((R, 0))
    if cost.striping == "engine" and nf:
        # Each NIC its own port; a flow becomes one sub-flow per NIC carrying that NIC's pieces.
        n = max(cost.nics_per_gpu, 1)
        per_nic = engine_nic_bytes(ops, nbytes, src, n, cost.stripe_threshold, cost.max_piece)
        fb = np.zeros((nf, n))
        np.add.at(fb, fid, per_nic)
        fb[f_local] = 0.0
        fb[f_local, 0] = f_bytes[f_local]  # NVLink: one port as before
        keep = fb > 0
        sub_f, sub_k = np.nonzero(keep)  # sorted by flow, then NIC: a source's rounds stay in order
        s_bytes = fb[keep]
        s_local = f_local[sub_f]
        s_src, s_dst = f_src[sub_f], f_dst[sub_f]
        nic_bw = bw_nic / n
        # a sub-flow's own cap: its share of the flow's per-write cost, at one NIC's rate
        s_bw = np.where(s_local, bw_nv, nic_bw)
        s_cnt = f_count[sub_f] * s_bytes / np.maximum(f_bytes[sub_f], 1e-300)
        s_cap = s_bw * s_bytes / (s_bytes + s_cnt * cost.msg_overhead_us * 1e-6 * s_bw)
        # ports: per GPU, NIC k at 2k, NVLink at 1 (k = 0 only for NVLink)
        sport = np.where(s_local, s_src * (n + 1) + n, s_src * (n + 1) + sub_k)
        dport = np.where(s_local, s_dst * (n + 1) + n, s_dst * (n + 1) + sub_k)
        caps = np.tile(np.r_[np.full(n, nic_bw), bw_nv], max(T, R))
        sim_s = _run_window(s_src, s_dst, s_local, s_bytes, s_cap, ready[sub_f], T, R, bw_nic, bw_nv,
                            max(cost.window, 1) * n, ports=(sport, dport, caps[:T * (n + 1)],
                                                            caps[:R * (n + 1)]))
        nic_in = np.zeros((R, n))
        np.add.at(nic_in, (s_dst[~s_local], sub_k[~s_local]), s_bytes[~s_local])
    elif cost.window <= 1:
        sim_s = _run_flows(f_src, f_dst, f_local, f_bytes, f_cap, ready, T, R, bw_nic, bw_nv)
    else:
        sim_s = _run_window(f_src, f_dst, f_local, f_bytes, f_cap, ready, T, R, bw_nic, bw_nv, cost.window)
    sim_s += float(apply_s.max(initial=0.0)) + cost.push_overhead_s
    # lower bound: the slowest link
    out_nic = np.bincount(f_src[~f_local], weights=f_bytes[~f_local], minlength=T)
    out_nv = np.bincount(f_src[f_local], weights=f_bytes[f_local], minlength=T)
    in_nic = np.bincount(f_dst[~f_local], weights=f_bytes[~f_local], minlength=R)
    in_nv = np.bincount(f_dst[f_local], weights=f_bytes[f_local], minlength=R)
    bound = max(
        float(np.max((out_nic + g_in + g_out) / bw_nic, initial=0.0)),
        float(np.max(in_nic / bw_nic, initial=0.0)),
        float(np.max((out_nv + g_nv_in + g_nv_out) / bw_nv, initial=0.0)),
        float(np.max(in_nv / bw_nv, initial=0.0)),
    )
    quant_s = np.bincount(f_src, weights=prep, minlength=T)
    return SimResult(
        bound_s=bound, sim_s=sim_s, ratio=sim_s / bound if bound else 0.0, bytes_total=int(dense_bytes.sum()),
        bytes_out=(out_nic + out_nv).astype(np.int64), bytes_in=(in_nic + in_nv).astype(np.int64),
        writes_out=np.bincount(src, minlength=T), gather_bytes=int(g["nbytes"].sum()) if len(g) else 0,
        gather_s_max=float(np.maximum(gather_s, gather_nic_s).max(initial=0.0)),
        quant_s_max=float(quant_s.max(initial=0.0)), flows=nf, encode_s_max=float(encode_s.max(initial=0.0)),
        apply_s_max=float(apply_s.max(initial=0.0)), nic_bytes_in=nic_in)


def simulate_relay(p: Plan, source_hosts: Sequence[int], chain_hosts: Sequence[int],
                   cost: CostModel | None = None, chunk_bytes: int = 64 << 20) -> SimResult:
    """A fan-out through a relay chain (``Group.create(relay=True)``): ``p`` plans the sources' writes
    into the chain's head (one destination, on ``chain_hosts[0]``); every member forwards each chunk (the
    head's incoming data writes cut at ``chunk_bytes``, in the plan's order) to the next once all of it
    landed, over its NICs (NVLink where both are on one host). Store and forward, one chunk at a time
    per hop: member k has chunk c at ``max(member k has chunk c-1, member k-1 has chunk c) + its hop
    time``; the head has chunk c when the sources' push into it (``simulate``) has carried the bytes up to
    its end, at an even rate. With ``striping="engine"``, as the engine places them: the sources write
    side by side, each its chunks in order, one per NIC at a time (so in groups) where they stay whole;
    a chunk up to ``stripe_threshold`` crosses a hop whole on one NIC, the next on the next NIC.
    ``sim_s`` is when the tail has the last chunk, plus ``push_overhead_s``; ``bound_s`` the slowest
    link carrying the model once. Gathers and delta pushes are not modelled."""
    cost = cost or CostModel()
    head = simulate(p, source_hosts, list(chain_hosts[:1]),
                    CostModel(**{**asdict(cost), "push_overhead_s": 0.0}))
    nbytes = (p.ops["rows"] * p.ops["row_bytes"]).astype(np.float64)
    cap = float(max(int(chunk_bytes), 1))
    pieces = np.maximum(np.ceil(nbytes / cap), 1).astype(np.int64)
    size = np.repeat(nbytes / pieces, pieces)  # a write's chunks, equal (split_writes cuts whole rows)
    total = float(size.sum())
    hosts = np.asarray(chain_hosts, np.int64)
    hop_bw = np.where(hosts[1:] == hosts[:-1], cost.nvlink_bps, cost.nic_bps)  # member k-1 -> k
    nics = max(int(cost.nics_per_gpu), 1)
    have = head.sim_s * np.cumsum(size) / max(total, 1e-300)  # the head has chunk c
    if cost.striping == "engine" and len(size):
        # The sources write into the head side by side, each its own chunks in order, sharing the head's
        # links (all finish with the push into the head). A source's chunks up to stripe_threshold go
        # whole, one per NIC at a time, and land together: that source's chunks arrive in groups of its
        # NIC count, each group when its last byte is in (striped chunks one at a time).
        group = nics if bool(np.all(size <= cost.stripe_threshold)) else 1
        chunk_src = np.repeat(p.ops["src_rank"].astype(np.int64), pieces)
        for s in np.unique(chunk_src):
            idx = np.flatnonzero(chunk_src == s)
            mine = np.cumsum(size[idx])
            ends = np.minimum((np.arange(len(idx)) // group + 1) * group, len(idx)) - 1
            have[idx] = head.sim_s * mine[ends] / max(float(mine[-1]), 1e-300)
    for same_host, bw in zip(hosts[1:] == hosts[:-1], hop_bw, strict=True):
        order = np.argsort(have, kind="stable")  # a member forwards chunks in the order they land
        size, have = size[order], have[order]
        hop = size / bw + cost.msg_overhead_us * 1e-6 * np.ceil(size / max(cost.max_piece, 1))
        # striping="engine": the engine keeps a write up to stripe_threshold whole, on one NIC (the least
        # loaded), so such a chunk takes nics x its striped time on one lane while the next chunk goes
        # on another; longer chunks are cut over every NIC (one lane at the full rate).
        whole = (cost.striping == "engine" and nics > 1 and not same_host
                 and bool(np.all(size <= cost.stripe_threshold)))
        lanes = [0.0] * (nics if whole else 1)  # when each of the hop's lanes is free
        nxt = np.empty_like(have)
        for c in range(len(size)):
            k = min(range(len(lanes)), key=lanes.__getitem__)
            lanes[k] = max(lanes[k], have[c]) + hop[c] * len(lanes)
            nxt[c] = lanes[k]
        have = nxt
    sim_s = float(have.max()) if len(have) else 0.0
    bound = max([head.bound_s] + [total / float(bw) for bw in hop_bw])
    return SimResult(
        bound_s=bound, sim_s=sim_s + cost.push_overhead_s, ratio=(sim_s + cost.push_overhead_s) / bound
        if bound else 0.0, bytes_total=head.bytes_total, bytes_out=head.bytes_out,
        bytes_in=np.full(len(hosts), total).astype(np.int64), writes_out=head.writes_out,
        gather_bytes=head.gather_bytes, gather_s_max=head.gather_s_max, quant_s_max=head.quant_s_max,
        flows=head.flows, nic_bytes_in=head.nic_bytes_in)


def engine_nic_bytes(ops: np.ndarray, nbytes: np.ndarray, src: np.ndarray, nics: int,
                     stripe_threshold: int = 1 << 20, max_piece: int = 16 << 20) -> np.ndarray:
    """Bytes of every op on each of the source's ``nics`` NICs, as the engine places them: a write (a
    2-D write whose rows are apart at the destination: each row) up to ``stripe_threshold`` is one piece,
    a longer one equal pieces (a multiple of the NIC count, 4 KiB aligned, at most ``max_piece``); each
    piece goes to the NIC with the fewest of the destination's bytes placed and not yet finished
    (``Engine::place``), ties to the next NIC after the pair's last. Modelled as a burst, nothing
    finishing in between: the least loaded NIC is the one with the fewest bytes placed so far for that
    (source, destination). Returns shape (ops, nics). ``nbytes``: each op's bytes on the wire. One step
    per piece (a Python loop): meant for the emulated cluster's plans, not for 1T-parameter ones."""
    n = max(int(nics), 1)
    out = np.zeros((len(ops), n))
    if not len(ops):
        return out
    dst = ops["dst_rank"].astype(np.int64)
    # Rows that land contiguously (dst_pitch == row_bytes) are packed on the sender and go as one write;
    # rows apart at the destination are one write each (a one-sided write cannot scatter).
    rows = np.maximum(ops["rows"].astype(np.int64), 1)
    rows = np.where(ops["dst_pitch"] == ops["row_bytes"], 1, rows)
    L = np.maximum(np.ceil(nbytes / rows), 1).astype(np.int64)  # bytes per write (row) on the wire
    lim = min(int(stripe_threshold), int(max_piece))

    def ceil_div(a: np.ndarray, b: Any) -> np.ndarray:
        return (a + b - 1) // b

    count = n * ceil_div(L, n * int(max_piece))
    step = np.where(L <= lim, L, np.minimum(ceil_div(ceil_div(L, count), 4096) * 4096, int(max_piece)))
    m = ceil_div(L, step)  # pieces per row
    last = L - (m - 1) * step
    load: dict[tuple[int, int], list[float]] = {}
    turn: dict[tuple[int, int], int] = {}
    for i in range(len(ops)):
        pair = (int(src[i]), int(dst[i]))
        lo = load.setdefault(pair, [0.0] * n)
        nxt = turn.get(pair, 0)
        sizes = [float(step[i])] * (int(m[i]) - 1) + [float(last[i])]
        for _row in range(int(rows[i])):
            for size in sizes:
                k = min(range(n), key=lambda j, lo=lo, nxt=nxt: (lo[j], (j - nxt) % n))
                lo[k] += size
                out[i, k] += size
                nxt = (k + 1) % n
        turn[pair] = nxt
    # the rows' rounding to whole bytes: scale back to the op's bytes
    tot = out.sum(axis=1)
    return out * (nbytes / np.maximum(tot, 1e-300))[:, None]


def delta_wire_ratio(changed: float, elem_bytes: np.ndarray) -> np.ndarray:
    """Bytes a delta push sends per byte of a dense one, for elements of ``elem_bytes`` bytes of which a
    fraction ``changed`` changed: the smaller of 16-bit block indices and a bitmap (plus the values),
    never more than the write itself (weightsync/delta/)."""
    e = np.asarray(elem_bytes, np.float64)
    per_element = np.minimum(changed * (2.0 + e), 1.0 / 8.0 + changed * e)
    return np.minimum(per_element / e, 1.0)


def _run_flows(f_src: np.ndarray, f_dst: np.ndarray, f_local: np.ndarray, f_eff: np.ndarray,
               f_bw: np.ndarray, ready: np.ndarray, T: int, R: int, bw_nic: float, bw_nv: float,
               trace: dict[str, np.ndarray] | None = None) -> float:
    """Event-driven max-min sharing of destination ingress; one flow at a time per source."""
    nf = len(f_src)
    if nf == 0:
        return 0.0
    src_first = np.searchsorted(f_src, np.arange(T + 1))
    rem = f_eff.astype(np.float64).copy()
    rate = np.zeros(nf)
    last = np.zeros(nf)
    version = np.zeros(nf, np.int64)
    t_start = np.zeros(nf)
    t_end = np.zeros(nf)
    if trace is not None:
        trace["start"], trace["end"] = t_start, t_end
    caps = f_bw
    port_bw = [bw_nic, bw_nv]
    active: dict[tuple[int, int], set[int]] = {}
    heap: list[tuple[float, int, int, int]] = []  # (time, kind 0=start 1=finish, flow, version)
    for s in range(T):
        a = int(src_first[s])
        if a < int(src_first[s + 1]):
            heapq.heappush(heap, (float(ready[a]), 0, a, 0))

    def reshare(port: tuple[int, int], now: float) -> None:
        flows = active.get(port)
        if not flows:
            return
        fl = sorted(flows)
        for f in fl:
            rem[f] -= rate[f] * (now - last[f])
            last[f] = now
        cap_sorted = sorted(fl, key=lambda f: caps[f])
        left = port_bw[port[1]]
        n = len(cap_sorted)
        for i, f in enumerate(cap_sorted):
            share = left / (n - i)
            r = min(caps[f], share)
            rate[f] = r
            left -= r
        for f in fl:
            version[f] += 1
            t_end = now + max(rem[f], 0.0) / rate[f]
            heapq.heappush(heap, (t_end, 1, f, int(version[f])))

    now = 0.0
    while heap:
        t, kind, f, ver = heapq.heappop(heap)
        if kind == 1 and ver != version[f]:
            continue
        now = t
        port = (int(f_dst[f]), int(f_local[f]))
        if kind == 0:
            t_start[f] = now
            last[f] = now
            rate[f] = 0.0
            active.setdefault(port, set()).add(f)
            reshare(port, now)
        else:
            t_end[f] = now
            active[port].discard(f)
            rate[f] = 0.0
            reshare(port, now)
            nxt = f + 1
            s = int(f_src[f])
            if nxt < int(src_first[s + 1]):
                heapq.heappush(heap, (max(now, float(ready[nxt])), 0, nxt, 0))
    return now


# ==================================================================================================
# From a model config to a simulated push


def run_model(model: str | Path, trainers: int = 256, trainer_layout: str = "hsdp:8",
              inference_gpus: int = 128, replica_gpus: int = 16, inference_dtype: str = "fp8",
              cost: CostModel | None = None, gpus_per_host: int = 8, round_bytes: int = 256 << 20,
              echo: Any = None) -> dict[str, Any]:
    """Build both layouts from a config, plan, simulate; returns the summary the CLI prints."""
    from weightsync.sim.models import counts, inference_layouts, load_config, trainer_layouts

    cost = cost or CostModel()
    say = echo or (lambda *_: None)
    cfg = load_config(model)
    t0 = time.perf_counter()
    src = trainer_layouts(cfg, trainers, trainer_layout)
    dst = inference_layouts(cfg, inference_gpus, replica_gpus, inference_dtype)
    t1 = time.perf_counter()
    load_before = os.getloadavg()[0]
    cpu0 = time.process_time()
    s_hosts = [r // gpus_per_host for r in range(trainers)]
    first_inf_host = (trainers + gpus_per_host - 1) // gpus_per_host
    d_hosts = [first_inf_host + r // gpus_per_host for r in range(inference_gpus)]
    p = plan(src, dst, source_hosts=s_hosts, destination_hosts=d_hosts,
             fp8_block=(128, 128) if inference_dtype == "fp8" else None, round_bytes=round_bytes,
             validate=False)
    t2 = time.perf_counter()
    plan_cpu = time.process_time() - cpu0
    say(f"layouts built in {t1 - t0:.2f} s, planned in {t2 - t1:.2f} s: {len(p):,} writes "
        f"({p.stats.get('seconds')})")
    res = simulate(p, s_hosts, d_hosts, cost)
    t3 = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    c = counts(cfg)
    out = {
        "model": cfg.get("_name", str(model)), "trainers": trainers, "trainer_layout": trainer_layout,
        "inference_gpus": inference_gpus, "replica_gpus": replica_gpus, "inference_dtype": inference_dtype,
        "tensors": len(src[0].table.names) if src else 0, "checkpoint_tensors": c["tensors"],
        "bytes_total": res.bytes_total, "bound_s": round(res.bound_s, 4), "sim_s": round(res.sim_s, 4),
        "ratio": round(res.ratio, 4), "plan_s": round(t2 - t1, 2), "plan_cpu_s": round(plan_cpu, 2),
        "layouts_s": round(t1 - t0, 2), "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "simulate_s": round(t3 - t2, 2), "peak_rss_gib": round(rss, 2), "writes": len(p),
        "writes_per_trainer_gpu": {k: round(v, 1) for k, v in
                                   res.summary()["writes_per_trainer"].items() if k != "imbalance"},
        "cost_model": asdict(cost),
    }
    out["detail"] = res.summary()
    return out


def _maxmin(f_sport: np.ndarray, f_dport: np.ndarray, f_cap: np.ndarray, sport_cap: np.ndarray,
            dport_cap: np.ndarray) -> np.ndarray:
    """Max-min fair rates of flows through a source port and a destination port each (progressive
    filling), each flow also capped by its own ``f_cap``."""
    n = len(f_sport)
    rate = np.zeros(n)
    live = np.ones(n, bool)
    s_left = sport_cap.astype(np.float64).copy()
    d_left = dport_cap.astype(np.float64).copy()
    for _ in range(64):
        if not live.any():
            break
        ns = np.bincount(f_sport[live], minlength=len(s_left))
        nd = np.bincount(f_dport[live], minlength=len(d_left))
        with np.errstate(divide="ignore", invalid="ignore"):
            inc_s = np.where(ns > 0, s_left / ns, np.inf).min()
            inc_d = np.where(nd > 0, d_left / nd, np.inf).min()
        inc_f = (f_cap[live] - rate[live]).min()
        inc = max(min(inc_s, inc_d, inc_f), 0.0)
        rate[live] += inc
        s_left -= inc * ns
        d_left -= inc * nd
        tol = 1e-9 * max(float(sport_cap.max(initial=1.0)), 1.0)
        sat = (s_left[f_sport] <= tol) | (d_left[f_dport] <= tol) | (rate >= f_cap - tol)
        live &= ~sat
    return rate


def _run_window(f_src: np.ndarray, f_dst: np.ndarray, f_local: np.ndarray, f_bytes: np.ndarray,
                f_cap: np.ndarray, ready: np.ndarray, T: int, R: int, bw_nic: float, bw_nv: float,
                window: int, steps: int = 3000,
                ports: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None) -> float:
    """Time-stepped flow simulation: each source keeps up to ``window`` of its rounds in flight (in
    order), its egress and every destination's ingress shared max-min fairly. When a flow ends inside
    a step, the source's next round inherits the rest of the step. ``ports``: each flow's source and
    destination port and the ports' capacities (default: per GPU, one NIC port and one NVLink port)."""
    nf = len(f_src)
    if nf == 0:
        return 0.0
    src_first = np.searchsorted(f_src, np.arange(T + 1))
    nxt = src_first[:-1].copy()
    end = src_first[1:]
    rem = f_bytes.astype(np.float64).copy()
    active: list[int] = []
    # ports: sources (NIC, NVLink), destinations (NIC, NVLink)
    if ports is None:
        sport = f_src * 2 + f_local.astype(np.int64)
        dport = f_dst * 2 + f_local.astype(np.int64)
        sport_cap = np.tile([bw_nic, bw_nv], T)
        dport_cap = np.tile([bw_nic, bw_nv], R)
    else:
        sport, dport, sport_cap, dport_cap = ports
    total = float(f_bytes.sum())
    est = max(total / (min(T, R) * min(bw_nic, bw_nv)), 1e-9)
    dt = est / steps * 4
    now = 0.0
    done_count = 0

    def refill(s: int, now: float) -> None:
        while nxt[s] < end[s] and sum(1 for f in active if f_src[f] == s) < window and ready[nxt[s]] <= now:
            active.append(int(nxt[s]))
            nxt[s] += 1

    for s in range(T):
        refill(s, now)
    while done_count < nf:
        if not active:
            pending = [ready[nxt[s]] for s in range(T) if nxt[s] < end[s]]
            now = max(now, min(pending))
            for s in range(T):
                refill(s, now)
            continue
        af = np.array(active, np.int64)
        rate = _maxmin(sport[af], dport[af], f_cap[af], sport_cap, dport_cap)
        moved = rate * dt
        fin = moved >= rem[af] - 1e-6
        rem[af] -= moved
        now += dt
        if fin.any():
            still = []
            for f, r_, ended in zip(af.tolist(), rate.tolist(), fin.tolist(), strict=True):
                if ended:
                    done_count += 1
                    s = int(f_src[f])
                    left_t = -rem[f] / r_ if r_ > 0 else 0.0  # unused part of the step
                    # the source's next round starts inside this step with the time left
                    if nxt[s] < end[s] and ready[nxt[s]] <= now:
                        g = int(nxt[s])
                        rem[g] -= left_t * r_
                else:
                    still.append(f)
            active = still
            for s in set(int(f_src[f]) for f in af[fin].tolist()):
                refill(s, now)
        # sources whose rounds became ready
        if len(active) < T * window:
            for s in range(T):
                if nxt[s] < end[s] and ready[nxt[s]] <= now:
                    refill(s, now)
    return now
