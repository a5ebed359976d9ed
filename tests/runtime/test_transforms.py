"""Transforms on the sender: casts and FP8 e4m3 128x128 block quantization, checked bit for bit against
a reference quantizer applied to the full tensor (written here, tile by tile, independently of
weightsync.runtime.transforms).

Two levels: the planner + lowering + sender preparation run in-process with a data plane made of byte
copies (every write of ``lower`` applied as it says), and the same through Ray Sources/Destinations and
the engine on CPU (tests/transform_actors.py-free: the actors are defined in tests/group_actors.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import weightsync as ws
from tests.support.fp8 import FP8, reference_fp8, same_bits
from tests.support.plan_executor import byte_view
from weightsync.plan import T_CAST, T_FP8, T_SCALE, plan
from weightsync.plan.writes import K_GATHER, lower
from weightsync.runtime.describe import describe_tensors
from weightsync.runtime.transforms import Preparer, quantize_fp8_blocks


def test_quantizer_matches_reference_on_odd_shapes() -> None:
    g = torch.Generator().manual_seed(1)
    for shape in [(333, 300), (128, 128), (1, 5), (129, 257)]:
        x = torch.randn(shape, generator=g) * 3
        x[: min(shape[0], 128), : min(shape[1], 128)] = 0.0  # an all-zero tile
        q, s = quantize_fp8_blocks(x)
        rq, rs = reference_fp8(x)
        assert same_bits(q, rq) and same_bits(s, rs), shape
        assert float(s[0, 0]) == float(torch.tensor(1e-4, dtype=torch.float32) / 448.0)  # all-zero tile
        xb = x.to(torch.bfloat16)
        q, s = quantize_fp8_blocks(xb)
        rq, rs = reference_fp8(xb)
        assert same_bits(q, rq) and same_bits(s, rs), shape


# ------------------------------------------------------------------------------------------------
# The model of these tests: three FSDP sources (dim-0 shards at 100 and 250: not multiples of 128) and
# two destinations with TP splits.

# w1, w2: FP8 with tiles across the source shards; t: FP8, the whole tensor one tile (its owner gathers
# all of it), destination 1 holds only rows 30.. of it; c: cast to bf16; n: cast to fp16, replicated.
SHAPES = {"w1": (333, 300), "w2": (200, 130), "t": (100, 90), "c": (37, 50), "n": (50,)}
SRC_DTYPE = {"w1": torch.float32, "w2": torch.bfloat16, "t": torch.float32, "c": torch.float32,
             "n": torch.float32}
CUTS = [0, 100, 250]


def full_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {k: (torch.randn(s, generator=g) * 2).to(SRC_DTYPE[k]) for k, s in SHAPES.items()}
    out["w1"][128:256, 128:256] = 0  # one all-zero tile
    return out


def source_tensors(rank: int, full: dict[str, torch.Tensor], cuts_of_333: list[int] = CUTS,
                   device: str = "cpu") -> tuple[dict, dict[str, torch.Tensor]]:
    """Rank ``rank`` of len(cuts_of_333) FSDP sources: dim-0 shards cut at these rows of 333 (scaled to
    each tensor's rows)."""
    named: dict = {}
    local: dict[str, torch.Tensor] = {}
    for k, t in full.items():
        if k == "n":
            named[k] = local[k] = t.clone().to(device)
            continue
        rows = t.shape[0]
        cuts = [min(c * rows // 333, rows) for c in cuts_of_333] + [rows]
        a, b = cuts[rank], cuts[rank + 1]
        local[k] = t[a:b].clone().to(device)
        named[k] = ws.Sharded(local[k], t.shape, (a, 0))
    return named, local


def destination_want(rank: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    q1, s1 = reference_fp8(full["w1"])
    q2, s2 = reference_fp8(full["w2"])
    qt, st = reference_fp8(full["t"])
    if rank == 0:
        return {"w1": q1[:256], "w1_scale_inv": s1[:2], "w2": q2[:, :128].contiguous(),
                "w2_scale_inv": s2[:, :1].contiguous(), "t": qt, "t_scale_inv": st,
                "c": full["c"].to(torch.bfloat16), "n": full["n"].to(torch.float16)}
    return {"w1": q1[256:], "w1_scale_inv": s1[2:], "w2": q2[:, 128:].contiguous(),
            "w2_scale_inv": s2[:, 1:].contiguous(), "t": qt[30:], "t_scale_inv": st,
            "c": full["c"].to(torch.bfloat16), "n": full["n"].to(torch.float16)}


def destination_tensors(rank: int, device: str = "cpu") -> tuple[dict, dict[str, torch.Tensor]]:
    """Poisoned destination tensors (0x7f bytes: NaN in fp8, a huge value in the others)."""
    shapes = {k: v.shape for k, v in destination_want(rank, full_tensors(0)).items()}
    dt = {"w1": FP8, "w2": FP8, "t": FP8, "w1_scale_inv": torch.float32, "w2_scale_inv": torch.float32,
          "t_scale_inv": torch.float32, "c": torch.bfloat16, "n": torch.float16}
    local = {}
    for k in shapes:
        n = int(np.prod(shapes[k])) * torch.empty(0, dtype=dt[k]).element_size()
        local[k] = torch.full((n,), 0x7F, dtype=torch.uint8, device=device).view(dt[k]).view(shapes[k])
    r0 = 0 if rank == 0 else 256
    c0 = 0 if rank == 0 else 128
    named = {
        "w1": ws.Sharded(local["w1"], SHAPES["w1"], (r0, 0)),
        "w1_scale_inv": ws.Sharded(local["w1_scale_inv"], (3, 3), (r0 // 128, 0)),
        "w2": ws.Sharded(local["w2"], SHAPES["w2"], (0, c0)),
        "w2_scale_inv": ws.Sharded(local["w2_scale_inv"], (2, 2), (0, c0 // 128)),
        "t": ws.Sharded(local["t"], SHAPES["t"], (0 if rank == 0 else 30, 0)),
        "t_scale_inv": local["t_scale_inv"],
        "c": local["c"], "n": local["n"],
    }
    return named, local


def run_in_process(p: ws.Plan, src_local: list[dict[str, torch.Tensor]],
                   dst_local: list[dict[str, torch.Tensor]], chunk_bytes: int) -> list[int]:
    """Executes every source's lowered writes with byte copies: gathers into poisoned receive buffers
    first, then direct writes and staged chunks. Returns each source's largest chunk."""
    dst_views = [{k: byte_view(v) for k, v in d.items()} for d in dst_local]

    def src_bytes(t: torch.Tensor) -> np.ndarray:
        return t.reshape(-1).view(torch.uint8).cpu().numpy()

    lows, preps = [], []
    for i in range(p.num_sources):
        part = p.part(sources=[i])
        provided = part.gathers[part.gathers["provider"] == i]
        lw = lower(p.for_source(i), chunk_bytes, part, provided)
        prep = Preparer(src_local[i], part, lw, i)
        device = next(iter(src_local[i].values())).device
        prep.recv = torch.full((max(prep.recv_bytes, 1),), 0x7F, dtype=torch.uint8, device=device)
        lows.append(lw)
        preps.append(prep)
    largest = [int(lw.chunks["nbytes"].max(initial=0)) for lw in lows]
    out = torch.empty(chunk_bytes, dtype=torch.uint8, device=next(iter(src_local[0].values())).device)
    for phase in ("gather", "data"):
        for i, (lw, prep) in enumerate(zip(lows, preps, strict=True)):
            w = lw.writes
            is_g = w["kind"] == K_GATHER
            if phase == "data":
                for x in w[(w["staged"] == 0)]:
                    src = src_bytes(src_local[i][p.keys[int(x["src_key"])]])
                    dv = dst_views[int(x["dst_rank"])][p.keys[int(x["dst_key"])]]
                    a, n = int(x["src_offset"]), int(x["nbytes"])
                    dv[int(x["dst_offset"]):int(x["dst_offset"]) + n] = src[a:a + n]
            chunks = np.unique(w["chunk"][(w["staged"] == 1) & (is_g if phase == "gather" else ~is_g)])
            for c in chunks.tolist():
                out.fill_(0xEE)
                prep.fill(c, out)
                for x in w[w["chunk"] == c]:
                    a, n, d = int(x["src_offset"]), int(x["nbytes"]), int(x["dst_offset"])
                    if int(x["kind"]) == K_GATHER:
                        preps[int(x["dst_rank"])].recv[d:d + n] = out[a:a + n]
                    else:
                        dv = dst_views[int(x["dst_rank"])][p.keys[int(x["dst_key"])]]
                        dv[d:d + n] = out[a:a + n].cpu().numpy()
    return largest


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("chunk_bytes", [64 << 10, 8 << 20])
@pytest.mark.parametrize("cuts", [CUTS, [0, 150]])
def test_fp8_and_casts_in_process(chunk_bytes: int, device: str, cuts: list[int]) -> None:
    """Sources' tensors on ``device``: the sender quantizes and casts there; the bytes must not
    depend on where. With a cut at 150 the first source's tiles are all its own (no gather)."""
    full = full_tensors(7)
    srcs = [source_tensors(i, full, cuts, device) for i in range(len(cuts))]
    dsts = [destination_tensors(j) for j in range(2)]
    p = plan([describe_tensors(s[0]) for s in srcs], [describe_tensors(d[0]) for d in dsts],
             source_hosts=["a", "a", "b"][:len(cuts)], destination_hosts=["a", "b"], allow_cast=True,
             fp8_block=(128, 128))
    tr = set(p.ops["transform"].tolist())
    assert {T_CAST, T_FP8, T_SCALE} <= tr
    assert len(p.gathers) > 0  # tiles span the shards at 100 and 250
    largest = run_in_process(p, [s[1] for s in srcs], [d[1] for d in dsts], chunk_bytes)
    assert max(largest) <= chunk_bytes
    for j in range(2):
        want = destination_want(j, full)
        got = dsts[j][1]
        for k in want:
            assert same_bits(got[k], want[k]), f"destination {j} tensor {k}"


def test_three_dimensional_fp8_in_process() -> None:
    """Stacked experts (E, rows, cols): every 2-D slice has its own tiles; sources shard dim 1."""
    g = torch.Generator().manual_seed(3)
    full = torch.randn(3, 300, 200, generator=g)
    cuts = [0, 70, 190, 300]
    srcs = []
    for i in range(3):
        loc = full[:, cuts[i]:cuts[i + 1]].clone()
        srcs.append(({"e": ws.Sharded(loc, full.shape, (0, cuts[i], 0))}, {"e": loc}))
    q = torch.full((3, 300, 200), 0x7F, dtype=torch.uint8).view(FP8)
    s = torch.full((3 * 3 * 2,), float("nan")).view(3, 3, 2)
    p = plan([describe_tensors(x[0]) for x in srcs], [describe_tensors({"e": q, "e_scale_inv": s})],
             fp8_block=(128, 128))
    run_in_process(p, [x[1] for x in srcs], [{"e": q, "e_scale_inv": s}], 64 << 10)
    for e in range(3):
        rq, rs = reference_fp8(full[e])
        assert same_bits(q[e], rq) and same_bits(s[e], rs), e


# ------------------------------------------------------------------------------------------------
# End to end through Ray: Sources, Destinations, the engine, gathers between sources.


class FP8Trainer:
    def __init__(self, group: str, rank: int, staging_bytes: int | None, chunk_bytes: int | None,
                 cuts: list[int] = CUTS, device: str = "cpu", one_writer: bool | None = None) -> None:
        self.rank, self.cuts, self.device = rank, cuts, device
        named, self.local = source_tensors(rank, full_tensors(100), cuts, device)
        self.src = ws.Source(group, rank=rank, tensors=named, staging_bytes=staging_bytes,
                             chunk_bytes=chunk_bytes, one_writer_at_a_time=one_writer)

    def push(self, version: int) -> dict:
        # Update in place (as an optimizer step would), then push.
        _, fresh = source_tensors(self.rank, full_tensors(100 + version), self.cuts, self.device)
        for k, t in self.local.items():
            t.copy_(fresh[k])
        return ws.push(self.src, version=version, timeout=60.0).__dict__


class FP8Rollout:
    def __init__(self, group: str, rank: int, device: str = "cpu", mode: str = "inplace") -> None:
        named, self.local = destination_tensors(rank, device)
        self.dst = ws.Destination(group, rank=rank, tensors=named, mode=mode)

    def wait(self, version: int) -> int:
        return self.dst.wait(version, timeout=60.0)

    def snapshot(self) -> dict[str, torch.Tensor]:
        # raw bytes: what landed, bit for bit (staged: made live first)
        self.dst.apply()
        return {k: v.contiguous().view(torch.uint8).cpu().clone() for k, v in self.local.items()}


def _push_and_check(ray: object, name: str, trainers: list, rollouts: list, staging: int | None,
                    chunk: int | None) -> None:
    ray.get([a.__ray_ready__.remote() for a in trainers + rollouts], timeout=180)
    for version in range(2):
        stats = ray.get([t.push.remote(version) for t in trainers], timeout=180)
        assert all(s["failed_destinations"] == [] for s in stats), stats
        assert ray.get([r.wait.remote(version) for r in rollouts], timeout=60) == [version] * 2
        full = full_tensors(100 + version)
        for j, r in enumerate(rollouts):
            got = ray.get(r.snapshot.remote(), timeout=60)
            want = destination_want(j, full)
            for k, w in want.items():
                assert torch.equal(got[k], w.contiguous().view(torch.uint8)), \
                    f"destination {j} tensor {k} at version {version}"
        for s in stats:
            assert 0 < s["peak_staging_bytes"] <= s["staging_limit_bytes"], s
            assert s["chunks"] > 0 and s["prepare_seconds"] > 0 and s["write_seconds"] > 0
        if staging is not None and chunk is not None:
            assert all(s["staging_limit_bytes"] == staging for s in stats)
            assert max(s["chunks"] for s in stats) > staging // chunk  # slots were reused
        assert sum(s["gather_bytes"] for s in stats) > 0  # tiles across shard edges that are not 128k


@pytest.mark.parametrize("one_writer", [False, True])
def test_fp8_push_through_ray_small_watermark(ray_cluster, one_writer: bool) -> None:
    """One pass over the chunks writing every destination (the default), and one pass per destination
    (``one_writer_at_a_time``: each destination has one writer at a time)."""
    ray = ray_cluster
    name = f"fp8-e2e-{one_writer}"
    staging, chunk = 128 << 10, 64 << 10  # 2 slots: more chunks than slots
    group = ws.Group.create(name, num_sources=3, num_destinations=2, allow_cast=True)
    trainers = [ray.remote(num_cpus=0)(FP8Trainer).remote(name, i, staging, chunk, CUTS, "cpu", one_writer)
                for i in range(3)]
    rollouts = [ray.remote(num_cpus=0)(FP8Rollout).remote(name, j, "cpu", mode)
                for j, mode in enumerate(["inplace", "staged"])]
    try:
        _push_and_check(ray, name, trainers, rollouts, staging, chunk)
    finally:
        for a in trainers + rollouts:
            ray.kill(a)
        group.shutdown()


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_gpus() < 4, reason="needs 4 GPUs (2 trainers, 2 rollouts)")
@pytest.mark.parametrize("staging", [None, 128 << 10])
def test_fp8_push_through_ray_on_gpus(ray_cluster, staging: int | None) -> None:
    """The same model on GPUs: 2 trainers (shards cut at row 150 of 333) to 2 rollouts over the cuda
    lane; quantization and casts on the trainers' GPUs; the default watermark and a small one."""
    ray = ray_cluster
    name = f"fp8-gpu-{staging}"
    chunk = None if staging is None else 64 << 10
    group = ws.Group.create(name, num_sources=2, num_destinations=2, allow_cast=True)
    actor = ray.remote(num_cpus=0, num_gpus=1)(FP8Trainer)
    trainers = [actor.remote(name, i, staging, chunk, [0, 150], "cuda") for i in range(2)]
    rollouts = [ray.remote(num_cpus=0, num_gpus=1)(FP8Rollout).remote(name, j, "cuda") for j in range(2)]
    try:
        _push_and_check(ray, name, trainers, rollouts, staging, chunk)
    finally:
        for a in trainers + rollouts:
            ray.kill(a)
        group.shutdown()


# ------------------------------------------------------------------------------------------------
# Refusals


def _fp8_dest(name: str, shape: tuple[int, ...], scales: bool) -> dict:
    d: dict = {name: torch.full(shape, 0x7F, dtype=torch.uint8).view(FP8)}
    if scales:
        d[name + "_scale_inv"] = torch.full((-(-shape[0] // 128), -(-shape[-1] // 128)), float("nan"))
    return d


def test_fp8_without_scales_is_refused() -> None:
    src = describe_tensors({"w": torch.randn(200, 130)})
    with pytest.raises(ws.LayoutError, match=r"'w'.*'w_scale_inv'"):
        plan([src], [describe_tensors(_fp8_dest("w", (200, 130), scales=False))], fp8_block=(128, 128))
    with pytest.raises(ws.LayoutError, match=r"'w_scale_inv'"):  # FP8 not enabled: scales are unknown
        plan([src], [describe_tensors(_fp8_dest("w", (200, 130), scales=True))])


def test_fp8_of_a_vector_is_refused() -> None:
    src = describe_tensors({"b": torch.randn(300)})
    dst = {"b": torch.full((300,), 0x7F, dtype=torch.uint8).view(FP8),
           "b_scale_inv": torch.full((1, 3), float("nan"))}
    with pytest.raises(ws.LayoutError, match=r"'b'.*dimension"):
        plan([src], [describe_tensors(dst)], fp8_block=(128, 128))


def test_chunks_never_exceed_chunk_bytes_and_cover_every_destination_byte() -> None:
    """The lowering alone: every destination byte is written once, no chunk is larger than asked, the
    destination counters' writes are the same however the sender's watermark is set (it is not an
    input), and a chunk smaller than the minimum is refused."""
    full = full_tensors(11)
    srcs = [source_tensors(i, full) for i in range(3)]
    dsts = [destination_tensors(j) for j in range(2)]
    p = plan([describe_tensors(s[0]) for s in srcs], [describe_tensors(d[0]) for d in dsts],
             allow_cast=True, fp8_block=(128, 128))
    for chunk in (64 << 10, 1 << 20):
        covered = [{k: np.zeros(v.numel() * v.element_size(), np.int64) for k, v in d[1].items()}
                   for d in dsts]
        for i in range(3):
            part = p.part(sources=[i])
            lw = lower(p.for_source(i), chunk, part, part.gathers[part.gathers["provider"] == i])
            assert int(lw.chunks["nbytes"].max(initial=0)) <= chunk
            assert (lw.writes["nbytes"][lw.writes["staged"] == 1] <= chunk).all()
            for w in lw.data():
                covered[int(w["dst_rank"])][p.keys[int(w["dst_key"])]][
                    int(w["dst_offset"]):int(w["dst_offset"] + w["nbytes"])] += 1
        for j in range(2):
            for k, c in covered[j].items():
                assert (c == 1).all(), (j, k, int((c == 0).sum()), int((c > 1).sum()))
    with pytest.raises(ws.PlanError, match="too small"):
        lower(p.for_source(0), 1000, p)


def test_fp8_plan_round_trips_with_boxes_and_gathers() -> None:
    full = full_tensors(5)
    srcs = [source_tensors(i, full) for i in range(3)]
    dsts = [destination_tensors(j) for j in range(2)]
    p = plan([describe_tensors(s[0]) for s in srcs], [describe_tensors(d[0]) for d in dsts],
             allow_cast=True, fp8_block=(128, 128))
    q = ws.Plan.from_msgpack(p.to_msgpack())
    assert q == p and q.fp8_block == (128, 128) and len(q.boxes) and len(q.gathers)
    q.gathers["offset"][0] += 16
    assert q != p
    part = p.part(sources=[1])
    mine = (part.gathers["provider"] == 1) | (part.gathers["gatherer"] == 1)
    boxed = (part.ops["transform"] == T_FP8) | (part.ops["transform"] == T_SCALE)
    need = set(part.ops["src_key"][boxed].tolist()) | set(part.gathers["box"].tolist()) \
        | set(part.gathers["pbox"].tolist())
    assert mine.all() and need == set(part.boxes["id"].tolist())


def test_wide_tensor_units_split_columns_in_process() -> None:
    """128 rows of 700 columns exceed a 64 KiB chunk: units are bands of some tile columns. Two
    sources (cut at row 90), one full replica and one destination holding columns 384.. only."""
    g = torch.Generator().manual_seed(9)
    full = torch.randn(200, 700, generator=g).to(torch.bfloat16)
    srcs = []
    for a, b in ((0, 90), (90, 200)):
        loc = full[a:b].clone()
        srcs.append(({"w": ws.Sharded(loc, full.shape, (a, 0))}, {"w": loc}))
    q0 = torch.full((200, 700), 0x7F, dtype=torch.uint8).view(FP8)
    s0 = torch.full((2, 6), float("nan"))
    q1 = torch.full((200, 316), 0x7F, dtype=torch.uint8).view(FP8)
    s1 = torch.full((2, 3), float("nan"))
    d1 = {"w": ws.Sharded(q1, (200, 700), (0, 384)), "w_scale_inv": ws.Sharded(s1, (2, 6), (0, 3))}
    p = plan([describe_tensors(x[0]) for x in srcs],
             [describe_tensors({"w": q0, "w_scale_inv": s0}), describe_tensors(d1)], fp8_block=(128, 128))
    for i in range(2):
        part = p.part(sources=[i])
        lw = lower(p.for_source(i), 64 << 10, part, part.gathers[part.gathers["provider"] == i])
        assert len(lw.units) == 0 or (lw.units["c1"] - lw.units["c0"]).min() < 700  # columns were split
    run_in_process(p, [x[1] for x in srcs], [{"w": q0, "w_scale_inv": s0}, {"w": q1, "w_scale_inv": s1}],
                   64 << 10)
    rq, rs = reference_fp8(full)
    assert same_bits(q0, rq) and same_bits(s0, rs)
    assert same_bits(q1, rq[:, 384:].contiguous()) and same_bits(s1, rs[:, 3:].contiguous())


def test_cast_rows_larger_than_a_chunk_in_process() -> None:
    """A cast whose contiguous run (80 000 bf16 bytes) exceeds a 64 KiB chunk is cut inside the run;
    a strided pack (column slice) goes through staging too."""
    g = torch.Generator().manual_seed(4)
    v = torch.randn(40000, generator=g)
    m = torch.randn(64, 96, generator=g)
    out_v = torch.full((40000 * 2,), 0x7F, dtype=torch.uint8).view(torch.bfloat16)
    out_m = torch.full((64 * 48 * 4,), 0x7F, dtype=torch.uint8).view(torch.float32).view(64, 48)
    dst = {"v": out_v, "m": ws.Sharded(out_m, (64, 96), (0, 48))}
    p = plan([describe_tensors({"v": v, "m": m})], [describe_tensors(dst)], allow_cast=True)
    lw = lower(p.for_source(0), 64 << 10, p)
    assert len(lw.chunks) >= 2 and int(lw.chunks["nbytes"].max()) <= 64 << 10
    run_in_process(p, [{"v": v, "m": m}], [{"v": out_v, "m": out_m}], 64 << 10)
    assert same_bits(out_v, v.to(torch.bfloat16))
    assert torch.equal(out_m, m[:, 48:])
