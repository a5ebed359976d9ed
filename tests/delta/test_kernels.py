"""The delta sender's compare as Triton kernels (weightsync/delta/triton_kernels.py) against its torch
path, bit for bit: the changed words' positions and values each push finds, and the reference after it.

On CPU the kernels run under Triton's interpreter, in a subprocess (``TRITON_INTERPRET`` must be set
before triton is imported), and so does tests/delta/test_push.py's every-case push test with the
kernels forced on; on a CUDA machine with triton, the same cases run compiled, in this process
(``python3 -m pytest tests/delta/test_kernels.py -q``).

One sender holds keys of every word size (1, 2, 4, 8 bytes), several per space, sizes not multiples of a
tile, and each push changes them in a chosen way: random odd positions, nothing, everything, one element,
the last element of each key, NaN payloads / -0.0 / denormals, one dense tile among sparse ones. Each
push is found twice from the same reference: by the kernels (outputs and scratch filled with a poison
byte first) and by the torch ops; positions, values and the reference after ``finish`` must be equal.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.delta_paths import push_both_ways
from weightsync.delta.codec import ENC_BITMAP, ENC_IDX16

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = ("odd", "none", "all", "one", "last", "special", "dense_tile")


def _shapes(tile: int, aligned: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Keys of every word size, several per space; ``aligned``: every key's size a multiple of 16
    elements (its words 16-byte aligned in the reference: the kernels' vector loads), else sizes that
    are not multiples of a tile or of 16 bytes."""
    if aligned:
        return {"emb": ((3, tile + 16), torch.bfloat16), "norm": ((16,), torch.bfloat16),
                "proj": ((tile // 2 + 32,), torch.float32), "fp8": ((tile + 16,), torch.uint8),
                "acc": ((tile + 16,), torch.int64), "step": ((2,), torch.float64)}
    return {"emb": ((3, tile + 7), torch.bfloat16), "q": ((2 * tile,), torch.bfloat16),
            "norm": ((5,), torch.bfloat16), "proj": ((tile // 2 + 3,), torch.float32),
            "bias": ((1,), torch.float32), "fp8": ((tile + 1,), torch.uint8), "i8": ((100,), torch.int8),
            "step": ((3,), torch.float64), "acc": ((tile + 9,), torch.int64)}


INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _ints(t: torch.Tensor) -> torch.Tensor:
    return t.view(INTS[t.element_size()]).reshape(-1)


def _change(tensors: dict[str, torch.Tensor], case: str, g: torch.Generator, tile: int) -> None:
    """Changes the tensors in place (as integers, so every bit pattern is reachable)."""
    for name, t in tensors.items():
        iv = _ints(t)
        n = iv.numel()
        if case == "odd":
            k = max(1, n // 37)
            pos = (torch.randperm(n // 2 + n % 2, generator=g)[:k] * 2 + 1).clamp(max=n - 1)
            iv[pos] ^= 1
        elif case == "all":
            iv ^= 3
        elif case == "one" and name == "emb":
            iv[n // 2] ^= 1
        elif case == "last":
            iv[n - 1] ^= 1
        elif case == "special" and t.is_floating_point():
            f = t.reshape(-1)
            f[0] = 0.0 if bool(torch.signbit(f[0])) else -0.0  # the other zero
            f[n // 2] = float("nan")
            iv[n // 2] ^= 1 << 1  # a NaN of another payload
            if n > 2:
                tiny = torch.finfo(t.dtype).tiny
                f[1] = tiny / 4 if float(f[1]) != tiny / 4 else tiny / 8  # a denormal
        elif case == "dense_tile" and n > tile:
            iv[tile:2 * tile if n >= 2 * tile else n] ^= 5  # one tile all changed (overflowed), others few
            iv[3] ^= 1


def check_cases(device: str, slice_tiles: int = 3, aligned: bool = False,
                backend: str = "triton") -> list[str]:
    """Every case on ``device``; slices of ``slice_tiles`` tiles (several slices per space); the compares
    must have run on ``backend`` (``cuda``: weightsync.delta.cuda, else the Triton kernels).
    Returns what was checked, one line per push."""
    import weightsync as ws
    import weightsync.delta.triton_kernels as dk
    from weightsync.delta.sender import DeltaSender

    dev = torch.device(device)
    assert dk.enabled(dev), "the kernels are not enabled here"
    dk.COMPARE_SLICE = slice_tiles * dk.TILE
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for name, (shape, dtype) in _shapes(dk.TILE, aligned).items():
        raw = torch.randint(-(1 << 62), 1 << 62, (int(torch.Size(shape).numel()),), generator=g)
        t = torch.empty(shape, dtype=dtype)
        _ints(t).copy_(raw.to(_ints(t).dtype))
        tensors[name] = t.to(dev)
    engine = ws.TransferEngine()
    lines = []
    try:
        sender = DeltaSender(engine, tensors, dev, 0, True)
        assert sender.use_kernels
        sender.start()  # the first reference: a copy
        sender.finish(1, True)
        for sp in sender._spaces.values():
            sp.hint = 0  # the output buffers grow as they fill
        version = 1
        for case in CASES:
            host = {k: v.cpu() for k, v in tensors.items()}
            _change(host, case, g, dk.TILE)
            for k, v in host.items():
                tensors[k].copy_(v)
            for sp in sender._spaces.values():
                if sp.compactor is not None:
                    sp.compactor.poison = 0xA5
            version += 1
            got = push_both_ways(sender, version, case)
            for sp in sender._spaces.values():  # vector loads exactly where every key is aligned
                w = sp.word
                assert sp.compactor.vec == (16 // w if aligned else 1), (w, sp.compactor.vec)
                assert sp.compactor.backend == backend, (w, sp.compactor.backend)
            lines.append(f"{case}: " + ", ".join(f"w{w} {int(i.numel())}" for w, (i, _) in got.items()))
        sender.use_kernels = True
    finally:
        engine.close()
    return lines


def check_overflow_leaves_reference(device: str) -> None:
    """The first kernel alone: a sparse tile's changes go into its slot and the reference, an overflowed
    tile's reference stays as it was (the second kernel compares it again)."""
    import weightsync.delta.triton_kernels as dk

    dev = torch.device(device)
    n = 2 * dk.TILE + 100
    cur = torch.arange(n, dtype=torch.int32, device=dev)
    ref = cur.clone()
    ref[5] += 1  # tile 0: one change
    ref[dk.TILE:2 * dk.TILE] += 1  # tile 1: all changed (overflowed)
    ref[n - 1] += 1  # tile 2 (short): its last word
    old = ref.clone()
    c = dk.Compactor(4, torch.tensor([0, n]).numpy(), dev)
    c._tables([cur], ref)
    compact = dk._compact
    counts = torch.full((3,), -1, dtype=torch.int32, device=dev)
    slot_idx = torch.full((3 * dk.SLOT,), -1, dtype=torch.int16, device=dev)
    slot_val = torch.full((3 * dk.SLOT,), -1, dtype=torch.int32, device=dev)
    compact[(3,)](*c.tables, ref, counts, slot_idx, slot_val, 0, TILE=dk.TILE, SLOT=dk.SLOT, VEC=c.vec)
    assert counts.tolist() == [1, dk.TILE, 1]
    assert int(slot_idx[0]) == 5 and int(slot_val[0]) == 5
    assert int(slot_idx[2 * dk.SLOT]) == 99 and int(slot_val[2 * dk.SLOT]) == n - 1
    assert torch.equal(ref[dk.TILE:2 * dk.TILE], old[dk.TILE:2 * dk.TILE])  # overflowed: untouched
    assert int(ref[5]) == 5 and int(ref[n - 1]) == n - 1
    idx, vals = c.compare([cur], old, 0)  # both kernels, from the old reference
    want = torch.cat([torch.tensor([5]), torch.arange(dk.TILE, 2 * dk.TILE), torch.tensor([n - 1])]).to(dev)
    assert torch.equal(idx, want) and torch.equal(vals, want.to(torch.int32))
    assert torch.equal(old, cur)


def check_scatter(device: str, backend: str = "triton", enc: int = ENC_IDX16) -> int:
    """The receiver's scatter of an ENC_IDX16 or ENC_BITMAP stream with the kernel (contiguous runs)
    against the torch ops: entries of three keys, runs of two entries with one shift, a run of
    another shift in the same key, a strided entry (torch ops either way), changes at block edges and the
    stream's last word. Returns the changed words scattered."""
    import numpy as np

    import weightsync as ws
    from weightsync.delta.codec import ENC_STREAM, ENTRY_DTYPE, STREAM_DTYPE, encode_into, sparse_sizes
    from weightsync.delta.receiver import DeltaReceiver
    from weightsync.delta.units import BLOCK

    dev = torch.device(device)
    g = torch.Generator().manual_seed(3)
    sizes = {"a": 200_000, "b": 5000, "c": 10 * 50}
    # key, dst_off (words), rows, row words, pitch words, stream words
    layout = [(0, 0, 1, 70_000, 70_000), (0, 70_000, 1, 60_000, 60_000), (1, 100, 1, 3000, 3000),
              (2, 0, 10, 30, 50), (0, 150_000, 1, 50_000, 50_000)]
    entries = np.zeros(len(layout), ENTRY_DTYPE)
    data = 0
    for e, (key, dst, rows, row, pitch) in zip(entries, layout, strict=True):
        e["key"], e["enc"], e["word"], e["dst_off"] = key, ENC_STREAM, 2, 2 * dst
        e["rows"], e["row_bytes"], e["pitch"], e["data"] = rows, 2 * row, 2 * pitch, data
        data += rows * row
    n = data
    pick = torch.rand(n, generator=g) < 0.05
    pick[[0, BLOCK - 1, BLOCK, 2 * BLOCK, n - 1]] = True
    local = torch.nonzero(pick).reshape(-1)
    k = int(local.numel())
    vals = torch.randint(1, 1 << 15, (k,), generator=g).to(torch.int16)
    bounds = np.searchsorted(local.numpy(), np.append(entries["data"], n))
    entries["count"] = np.diff(bounds)
    assert enc in (ENC_IDX16, ENC_BITMAP)
    size = sparse_sizes(n, k, 2)[enc]
    streams = np.zeros(1, STREAM_DTYPE)
    streams[0] = (2, enc, n, k, 256, (0, 0, 0))
    engine = ws.TransferEngine()
    try:
        start = {key: torch.randint(-(1 << 15), 1 << 15, (m,), generator=g).to(torch.int16)
                 for key, m in sizes.items()}
        out = {}
        for use in (True, False):
            bufs = {key: [t.clone().to(dev)] for key, t in start.items()}
            recv = DeltaReceiver(engine, bufs, "inplace", dev, 256 + size + 64, 0)
            recv.payload.fill_(0xA5)
            encode_into(recv.payload[256:256 + size], enc, local.to(dev), vals.to(dev), n)
            recv.use_kernels = use
            recv._scatter_all(0, [(entries, streams, 0)])
            if use:
                assert recv.scatter_backend == backend, recv.scatter_backend
            out[use] = {key: b[0].cpu() for key, b in bufs.items()}
            engine.deregister(recv.payload_region)
            engine.deregister(recv.header_region)
        for key in sizes:
            assert torch.equal(out[True][key], out[False][key]), key
        assert not torch.equal(out[False]["a"], start["a"])
    finally:
        engine.close()
    return k


@pytest.mark.parametrize("enc", [ENC_IDX16, ENC_BITMAP])
def test_the_receivers_host_scatter_matches_the_torch_ops(enc: int) -> None:
    """On CPU the receiver's C++ scatter (an ENC_BITMAP stream's bits read into 16-bit indices first)
    against its torch ops, through DeltaReceiver."""
    from weightsync.delta import host as delta_host

    if not delta_host.available():
        pytest.skip("the compiled engine has no host delta kernels")
    assert check_scatter("cpu", backend="host", enc=enc) > 0


_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from tests.delta.test_kernels import check_cases, check_overflow_leaves_reference, check_scatter
check_overflow_leaves_reference("cpu")
print("scattered", check_scatter("cpu"))
for aligned in (False, True):
    for line in check_cases("cpu", aligned=aligned):
        print(line)
print("kernels ok")
"""


def _interpreter_triton() -> None:
    """Skips where Triton's interpreter cannot run the kernels: absent, or older than 3.7, whose
    interpreter fails on the scatter kernel's loop over bounds loaded from memory (seen with 3.6.0 on the
    GPU hosts, where the compiled kernels are tested instead)."""
    triton = pytest.importorskip("triton")
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    if (major, minor) < (3, 7):
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run the scatter kernel's loop over "
                    "loaded bounds (the compiled kernels are tested on CUDA)")


def test_kernels_match_the_torch_path_under_the_interpreter() -> None:
    _interpreter_triton()
    env = {**os.environ, "TRITON_INTERPRET": "1", "WEIGHTSYNC_DELTA_KERNELS": "1"}
    r = subprocess.run([sys.executable, "-c", _SCRIPT.format(root=ROOT)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "kernels ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    for case in CASES:
        assert f"{case}:" in r.stdout


_SUITE = """
import sys
sys.path.insert(0, {root!r})
import pytest
import weightsync.delta.triton_kernels as dk

calls = []
compare = dk.Compactor.compare


def counted(self, *args, **kwargs):
    calls.append(self.word)
    return compare(self, *args, **kwargs)


scatters = []
scatter = dk.scatter_idx16


def counted_scatter(*args, **kwargs):
    done = scatter(*args, **kwargs)
    scatters.append(done)
    return done


dk.Compactor.compare = counted
dk.scatter_idx16 = counted_scatter
rc = pytest.main(["tests/delta/test_push.py", "-q", "-x", "-p", "no:cacheprovider", "-k", {select!r}])
print("kernel scatters", sum(1 for x in scatters if x))
print("kernel compares", len(calls))
sys.exit(rc)
"""


def test_delta_pushes_with_the_kernels_under_the_interpreter() -> None:
    # The push-level delta test (every change case, inplace and staged destinations, a reader) with the
    # sources' compare and the destinations' idx16 scatter done by the kernels: every destination byte as
    # a dense push gives.
    _interpreter_triton()
    pytest.importorskip("ray")  # test_delta.py's coordinator
    env = {**os.environ, "TRITON_INTERPRET": "1", "WEIGHTSYNC_DELTA_KERNELS": "1"}
    r = subprocess.run([sys.executable, "-c", _SUITE.format(root=ROOT, select="test_every_case")], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    calls = int(r.stdout.rsplit("kernel compares", 1)[1].split()[0])
    scatters = int(r.stdout.rsplit("kernel scatters", 1)[1].split()[0])
    assert calls > 0 and scatters > 0, r.stdout[-3000:]


def _cuda_triton() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("TRITON_INTERPRET", "") != "1"


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_triton(), reason="needs CUDA and triton")
@pytest.mark.parametrize("slice_tiles,aligned", [(3, False), (1 << 20, False), (3, True), (1 << 20, True)])
def test_kernels_match_the_torch_path_on_cuda(slice_tiles: int, aligned: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import weightsync.delta.triton_kernels as dk

    monkeypatch.setattr(dk, "COMPARE_SLICE", dk.COMPARE_SLICE)  # check_cases changes it: restored after
    monkeypatch.setenv("WEIGHTSYNC_DELTA_KERNELS", "triton")
    check_overflow_leaves_reference("cuda")
    assert check_scatter("cuda") > 0
    lines: Any = check_cases("cuda", slice_tiles, aligned)
    assert len(lines) == len(CASES)


def _nvrtc() -> bool:
    from weightsync.delta import nvrtc

    try:
        nvrtc.nvrtc_library()
    except nvrtc.NvrtcUnavailable:
        return False
    return True


@pytest.mark.skipif(not _nvrtc(), reason="needs the NVRTC library (the test extra's nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90"])  # sm_75: no __reduce_or_sync
def test_the_cuda_compare_compiles(arch: str) -> None:
    """The CUDA C++ compare compiles (NVRTC needs no GPU): a source error shows on every CI run, not only
    on a GPU host."""
    from weightsync.delta import cuda as delta_cuda
    from weightsync.delta import nvrtc

    image = nvrtc.compile_to_cubin(delta_cuda.SOURCE, arch, list(delta_cuda.SIGNATURES))
    assert image[:4] == b"\x7fELF"
    with pytest.raises(nvrtc.NvrtcUnavailable, match="ws_compact_w3"):
        nvrtc.compile_to_cubin(delta_cuda.SOURCE, arch, ["ws_compact_w3"])
    with pytest.raises(nvrtc.NvrtcUnavailable, match="error"):
        nvrtc.compile_to_cubin(delta_cuda.SOURCE + "\nint broken(", arch, [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not _nvrtc(), reason="needs CUDA and NVRTC")
@pytest.mark.parametrize("slice_tiles,aligned", [(3, False), (3, True)])
def test_the_cuda_compare_matches_the_torch_path(slice_tiles: int, aligned: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case (hint 0: the first run's room is small, so the second run over the rest is taken in
    the cases that change much) against the torch ops, bit for bit, outputs poisoned first; and the
    receiver's scatter by the CUDA kernel against the torch ops."""
    import weightsync.delta.triton_kernels as dk
    from weightsync.delta import cuda as delta_cuda

    monkeypatch.setattr(dk, "COMPARE_SLICE", dk.COMPARE_SLICE)
    monkeypatch.setenv("WEIGHTSYNC_DELTA_KERNELS", "cuda")
    assert delta_cuda.module(torch.device("cuda")) is not None, delta_cuda.unavailable(torch.device("cuda"))
    assert check_scatter("cuda", backend="cuda") > 0
    assert check_scatter("cuda", backend="cuda", enc=ENC_BITMAP) > 0  # straight from its bits
    lines: Any = check_cases("cuda", slice_tiles, aligned, backend="cuda")
    assert len(lines) == len(CASES)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not _nvrtc(), reason="needs CUDA and NVRTC")
@pytest.mark.parametrize("word", [1, 2, 4, 8])
@pytest.mark.parametrize("aligned", [True, False])
def test_the_cuda_compare_over_many_tiles(word: int, aligned: bool) -> None:
    """Thousands of tiles, keys whose words and addresses are 16-byte aligned (vector loads) or of odd
    sizes at odd addresses (and an empty one), output room far too small (second run), against torch;
    each also launched ahead on a side stream and finished later, and with a search queued ahead on
    another. Searched within the room, the changes come as the collect left them: the search's answers
    (read with the count), their order, the reference's update and a stream's encode read from there
    must be what torch gives; past the room the host searches the ordered changes."""
    from weightsync.delta import cuda as delta_cuda
    from weightsync.delta.codec import _IndexWriter, _values_at, decode, sparse_sizes
    from weightsync.delta.triton_kernels import Compactor
    from weightsync.delta.units import _align, word_dtype

    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(word)
    dt = INTS[word]
    if aligned:
        sizes = [4096 * 700 + 16, 16, 4096 * 1300, 16, 4096 * 5 + 4080]
    else:
        sizes = [4096 * 700 + 3, 17, 0, 4096 * 1300, 1, 4096 * 5 + 4095]
    base = torch.randint(-(1 << 62), 1 << 62, (sum(sizes) + 64,), generator=g, device=dev).to(dt)
    views, a = [], 0
    for i, n in enumerate(sizes):
        off = a if aligned else a + (i % 3)  # some keys at addresses that are not 16-byte aligned
        views.append(base[off:off + n])
        a = off + n
    starts = torch.tensor([0, *sizes]).cumsum(0).numpy()
    ref = torch.cat(views).clone()
    for v in views:  # changes: sparse random, a dense run crossing tiles, the very last word
        m = torch.rand(v.numel(), generator=g, device=dev) < 0.02
        v[m] ^= 1
    views[0][4096 * 10 - 5:4096 * 13 + 7] ^= 3
    views[-1][-1] ^= 1
    cur = torch.cat(views)
    want = torch.nonzero(cur != ref).reshape(-1)
    k = len(want)
    # where the keys start, every change, the words around them, none changed (the total, 0)
    query = torch.cat([torch.from_numpy(starts).to(dev), want[::7], want[::11] + 1, want[::13] - 1,
                       torch.randint(0, int(starts[-1]), (500,), generator=g, device=dev)])
    # runs of changes for a stream (first change, shift to stream positions, first entry, count): the
    # changes cut in five with one slice left out (another write's), shifted into a stream of n words
    cuts = [0, k // 5, k // 5 + 7000, k // 2, k // 2 + 1, k]
    n = int(starts[-1]) + 5000
    runs, at = [], 0
    for r, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        if r != 1:
            runs.append((lo, 1000 * r + 3, at, hi - lo))
            at += hi - lo
    runs_np = np.array(runs, np.int64)
    size = sparse_sizes(n, at, word)[ENC_IDX16]
    room = k + 10
    for hint, ahead, searched in [(room, False, False), (1024, False, False), (room, True, False),
                                  (1024, True, False), (room, True, True), (1024, True, True)]:
        r = ref.clone()
        c = Compactor(word, starts, dev)
        c.poison = 0x5A
        if ahead:  # launched on a stream of its own, finished by the compare (second run there too)
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            assert c.launch(views, r, hint, side)
            assert c.pending is not None
            if searched:
                c.search_ahead(query, torch.cuda.Stream(dev, priority=-1))
        found = c.compare(views, r, hint)
        assert c.pending is None
        assert c.backend == "cuda", delta_cuda.unavailable(dev)
        assert c.vec == (16 // word if aligned else 1)
        assert not c.ref_updated and torch.equal(r, ref), hint  # the caller's to update
        if searched and hint > k:
            assert isinstance(found, delta_cuda.TileChanges), hint
            assert found.count == k
            assert c.cuts is not None
            assert c.cuts.tolist() == torch.searchsorted(want, query).tolist()
            # a stream's entries from the scratch, byte for byte what the ordered changes give
            idx, vals = found.ordered()
            outs = []
            for tiled in (False, True):
                out = torch.full((size,), 0xA5, dtype=torch.uint8, device=dev)
                values = out[_values_at(ENC_IDX16, n, at):][:word * at].view(word_dtype(word))
                index = _IndexWriter(out, ENC_IDX16, n, at, dev)
                index.reserve(at)
                if tiled:
                    lo_pos, hi_pos = int(want[0]), int(want[-1]) + 1
                    found.encode(runs_np, found.tile_range(lo_pos, hi_pos), index.low, values,
                                 index.kernel_counts())
                else:
                    delta_cuda.encode_runs(delta_cuda.module(dev), idx, vals, runs_np, index.low, values,
                                           index.kernel_counts())
                index.close()
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), hint
            sel = torch.cat([torch.arange(lo, lo + m, device=dev) for lo, _, _, m in runs])
            shifts = torch.cat([torch.full((m,), sh, device=dev) for _, sh, _, m in runs])
            low = outs[1][_align(4 * -(-n // 65536)):][:2 * at].view(torch.int16)
            assert torch.equal(low, ((want[sel] + shifts) & 0xFFFF).to(torch.int32).to(torch.int16))
            # the same runs as an ENC_BITMAP stream: by the index writer's torch ops, from the ordered
            # changes and from the scratch, byte for byte; read back, the runs' positions and values
            bsize = sparse_sizes(n, at, word)[ENC_BITMAP]
            bouts = []
            for how in ("torch", "ordered", "tiles"):
                out = torch.full((bsize,), 0xA5, dtype=torch.uint8, device=dev)
                values = out[_values_at(ENC_BITMAP, n, at):][:word * at].view(word_dtype(word))
                index = _IndexWriter(out, ENC_BITMAP, n, at, dev)
                if how == "torch":
                    index.mod = None
                    for lo, sh, o, m in runs:
                        index.add(idx[lo:lo + m], sh)
                        values[o:o + m].copy_(vals[lo:lo + m])
                elif how == "ordered":
                    index.reserve(at)
                    delta_cuda.encode_runs(delta_cuda.module(dev), idx, vals, runs_np, index.bits, values,
                                           None, bitmap=True)
                else:
                    index.reserve(at)
                    found.encode(runs_np, found.tile_range(int(want[0]), int(want[-1]) + 1), index.bits,
                                 values, None, bitmap=True)
                index.close()
                bouts.append(out)
            assert torch.equal(bouts[0], bouts[1]) and torch.equal(bouts[0], bouts[2]), hint
            got_local, got_vals = decode(bouts[2], ENC_BITMAP, n, at, word)
            assert torch.equal(got_local, want[sel] + shifts), hint
            assert torch.equal(got_vals, cur[want[sel]]), hint
            found.update_ref()
        else:  # past the room the collect ran again, and the caller searches
            assert isinstance(found, tuple), hint
            assert c.cuts is None, hint
            idx, vals = found
            r[idx] = vals
        assert torch.equal(idx, want), (hint, idx.numel(), want.numel())
        assert torch.equal(vals, cur[want]), hint
        assert torch.equal(r, cur), hint


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not _nvrtc(), reason="needs CUDA and NVRTC")
@pytest.mark.parametrize("word", [1, 2, 4, 8])
@pytest.mark.parametrize("enc", [ENC_IDX16, ENC_BITMAP])
def test_the_cuda_encode_matches_the_index_writer(word: int, enc: int) -> None:
    """A stream written by the CUDA encode (runs of the compare's output, a strided write's entries
    between them by the index writer: an ENC_BITMAP's bits by a kernel too) equals the one the index
    writer's torch ops write, byte for byte, both buffers poisoned first: its block counts and low bits
    or its bits, and its values."""
    from weightsync.delta import cuda as delta_cuda
    from weightsync.delta.codec import _IndexWriter, _values_at, decode, sparse_sizes
    from weightsync.delta.units import word_dtype

    dev = torch.device("cuda")
    mod = delta_cuda.module(dev)
    assert mod is not None, delta_cuda.unavailable(dev)
    g = torch.Generator(device="cuda").manual_seed(word)
    n = 3_000_017  # stream words (46 blocks and a short one)
    stream = torch.unique(torch.randint(0, n, (90_000,), generator=g, device=dev))
    k = int(stream.numel())
    cuts = [0, k // 5, k // 5 + 7000, k // 2, k // 2 + 1, k]  # run, strided piece, run, run of one, run
    kinds = ["run", "piece", "run", "run", "run"]
    space_idx, space_vals, runs = [], [], []
    at = 0
    for r, (a, b) in enumerate(itertools.pairwise(cuts)):
        if kinds[r] == "run":
            shift = -1000 * (r + 1) - 3  # space position = stream position - shift
            space_idx.append(stream[a:b] - shift)
            space_vals.append(torch.randint(-(1 << 62), 1 << 62, (b - a,), generator=g, device=dev))
            runs.append((at, shift, a, b - a))
            at += b - a
    idx = torch.cat(space_idx)
    vals = torch.cat(space_vals).to(word_dtype(word))
    piece_vals = torch.randint(-(1 << 62), 1 << 62, (k,), generator=g, device=dev).to(word_dtype(word))
    size = sparse_sizes(n, k, word)[enc]
    outs = []
    for use_kernel in (False, True):
        out = torch.full((size,), 0xA5, dtype=torch.uint8, device=dev)
        values = out[_values_at(enc, n, k):][:word * k].view(word_dtype(word))
        index = _IndexWriter(out, enc, n, k, dev)
        if enc == ENC_BITMAP:
            assert index.mod is not None  # its bits by a kernel, unless taken away here
            if not use_kernel:
                index.mod = None
        table = []
        for r, (a, b) in enumerate(itertools.pairwise(cuts)):
            if kinds[r] == "piece":
                index.add(stream[a:b], 0)
                values[a:b].copy_(piece_vals[a:b])
                continue
            lo, shift = next((x[0], x[1]) for x in runs if x[2] == a)
            if use_kernel:
                table.append((lo, shift, index.reserve(b - a), b - a))
            else:
                index.add(idx[lo:lo + b - a], shift)
                values[a:b].copy_(vals[lo:lo + b - a])
        if table and enc == ENC_BITMAP:
            delta_cuda.encode_runs(mod, idx, vals, table, index.bits, values, None, bitmap=True)
        elif table:
            delta_cuda.encode_runs(mod, idx, vals, table, index.low, values, index.kernel_counts())
        index.close()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    local, _ = decode(outs[1], enc, n, k, word)
    assert torch.equal(local, stream)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not _nvrtc(), reason="needs CUDA and NVRTC")
@pytest.mark.parametrize("enc", [ENC_IDX16, ENC_BITMAP])
@pytest.mark.parametrize("fault", ["one_too_many", "moved"])
def test_a_cuda_stream_that_does_not_match_its_entries_is_refused(enc: int, fault: str) -> None:
    check_refused("cuda", enc, fault)


@pytest.mark.parametrize("enc", [ENC_IDX16, ENC_BITMAP])
@pytest.mark.parametrize("fault", ["one_too_many", "moved"])
def test_a_host_stream_that_does_not_match_its_entries_is_refused(enc: int, fault: str) -> None:
    from weightsync.delta import host as delta_host

    if not delta_host.available():
        pytest.skip("the compiled engine has no host delta kernels")
    check_refused("cpu", enc, fault)


def check_refused(device: str, enc: int, fault: str) -> None:
    """A stream whose index does not match its entries fails the apply with a WeightSyncError naming it:
    one change too many (an ENC_IDX16 block count one higher, an ENC_BITMAP bit more), where none is
    stored (a value past the stream's would be read); or the first entry's last change moved past the
    second entry's first word (the counts hold), where that change is not stored (it would land in the
    first key past its end). Then, after the same stream scattered as an early span's (on CUDA queued,
    its flag unread; on CPU refused at once) and the version given up on, a good stream applies."""
    import numpy as np

    import weightsync as ws
    from weightsync.delta.codec import ENC_STREAM, ENTRY_DTYPE, STREAM_DTYPE, encode_into, sparse_sizes
    from weightsync.delta.receiver import DeltaReceiver
    from weightsync.delta.units import BLOCK, _align
    from weightsync.errors import WeightSyncError

    dev = torch.device(device)
    g = torch.Generator().manual_seed(11)
    n, half = 200_000, 100_000  # two entries of `half` words: key "a" then key "b"
    entries = np.zeros(2, ENTRY_DTYPE)
    for i, e in enumerate(entries):
        e["key"], e["enc"], e["word"], e["dst_off"] = i, ENC_STREAM, 2, 0
        e["rows"], e["row_bytes"], e["pitch"], e["data"] = 1, 2 * half, 2 * half, i * half
    local = torch.unique(torch.randint(0, n, (20_000,), generator=g))
    k = int(local.numel())
    in_a = int((local < half).sum())
    entries["count"] = [in_a, k - in_a]
    vals = torch.randint(1, 1 << 15, (k,), generator=g).to(torch.int16)
    size = sparse_sizes(n, k, 2)[enc]
    streams = np.zeros(1, STREAM_DTYPE)
    streams[0] = (2, enc, n, k, 256, (0, 0, 0))
    name = "ENC_IDX16" if enc == ENC_IDX16 else "ENC_BITMAP"
    engine = ws.TransferEngine()
    try:
        start = {key: torch.randint(-(1 << 15), 1 << 15, (half,), generator=g).to(torch.int16).to(dev)
                 for key in ("a", "b")}
        bufs = {key: [t.clone()] for key, t in start.items()}
        recv = DeltaReceiver(engine, bufs, "inplace", dev, 256 + size + 64, 0)
        assert recv.use_kernels
        stream = recv.payload[256:256 + size]
        recv.payload.fill_(0xA5)
        encode_into(stream, enc, local.to(dev), vals.to(dev), n)
        # a word of key "b" that no change names, in the block of the first entry's last change
        last_a = int(local[in_a - 1])
        assert last_a // BLOCK == half // BLOCK  # (the seed's: that block holds both entries' words)
        free = int(torch.nonzero(torch.isin(torch.arange(half, n), local, invert=True))[0]) + half
        assert free // BLOCK == last_a // BLOCK
        if enc == ENC_BITMAP:
            def flip(i: int) -> None:
                stream[i // 8] ^= 1 << (i % 8)

            flip(free)  # one too many
            if fault == "moved":
                flip(last_a)
        else:
            counts = stream[:4 * -(-n // BLOCK)].view(torch.int32)
            low = stream[_align(4 * -(-n // BLOCK)):][:2 * k].view(torch.int16)
            if fault == "one_too_many":
                counts[0] += 1
            else:
                low[in_a - 1] = ((free % BLOCK) ^ 0x8000) - 0x8000  # as int16
        # the change whose entry is the first's but whose word is the second's
        moved = free if enc == ENC_IDX16 else min(free, int(local[in_a]))
        recv._pending = [(entries, streams, 0)]
        with pytest.raises(WeightSyncError, match=rf"2-byte {name} stream .*does not match its entries"):
            recv.apply(0)
        if device == "cuda":  # (on CPU the scatter raised before saying which it was)
            assert recv.scatter_backend == "cuda"
        if fault == "one_too_many":  # nothing stored
            assert all(torch.equal(bufs[key][0], start[key]) for key in start)
        else:  # that change is not stored (in key "a" it would lie past the end)
            assert int(bufs["b"][0][moved - half]) == int(start["b"][moved - half])
        # queued as an early span's (its flag not read), then the version given up on: the next
        # version's good stream applies, whatever flag the bad one left set
        recv._pending = [(entries, streams, 0)]
        if device == "cuda":
            recv.apply(0, wait=False)
        else:
            with pytest.raises(WeightSyncError, match="does not match its entries"):
                recv.apply(0, wait=False)
        recv.granted(0)
        recv.payload.fill_(0xA5)
        encode_into(stream, enc, local.to(dev), vals.to(dev), n)
        recv._pending = [(entries, streams, 0)]
        recv.apply(0)
        got = torch.cat([bufs["a"][0], bufs["b"][0]]).cpu()
        want = torch.cat([start["a"], start["b"]]).cpu()
        want[local] = vals
        assert torch.equal(got, want)
        engine.deregister(recv.payload_region)
        engine.deregister(recv.header_region)
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not _nvrtc(), reason="needs CUDA and NVRTC")
def test_the_cuda_block_ends_are_the_prefix_of_the_counts() -> None:
    """``ws_block_ends`` (one block's scan) against torch's cumsum: fewer counts than threads, a count
    per thread and some over, thousands, counts up to a whole block's 65536."""
    from weightsync.delta import cuda as delta_cuda

    dev = torch.device("cuda")
    mod = delta_cuda.module(dev)
    assert mod is not None, delta_cuda.unavailable(dev)
    g = torch.Generator(device="cuda").manual_seed(5)
    for nb in [1, 7, 256, 257, 30_637, 131_072]:
        counts = torch.randint(0, 65537, (nb,), generator=g, device=dev, dtype=torch.int32)
        counts[:: 5] = 0
        want = torch.zeros(nb + 1, dtype=torch.int64, device=dev)
        torch.cumsum(counts, 0, out=want[1:])
        got = delta_cuda.block_ends(mod, counts)
        assert torch.equal(got, want), nb
