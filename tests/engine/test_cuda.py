"""The cuda lane between Ray GPU actors (each sees only its GPU as cuda:0). Skips without a GPU; the tests
on ``pair`` skip without two."""

from __future__ import annotations

import os
import random
import time

import msgpack
import pytest

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 1:
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import ray  # noqa: E402

import weightsync as ws  # noqa: E402
from tests.support.cuda_actors import GpuEnd  # noqa: E402

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30


@pytest.fixture(scope="module")
def ray_session():
    # num_cpus bounded: without it Ray counts every core of the host and starts workers to match (64 on
    # a 4-GPU host), which the suite then waits behind; 8 leaves room for every actor a test here holds.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pair(ray_session):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs (this machine has {torch.cuda.device_count()})")
    end = ray.remote(num_gpus=1)(GpuEnd)
    src, dst = end.remote(), end.remote()
    info = ray.get([src.info.remote(), dst.info.remote()])
    yield src, dst, info


def test_gpu_to_gpu_over_fabric_tcp_through_landing_ring(ray_session) -> None:
    """Two GPU processes of one host forced onto the NICs: cuda_peers=False on both, and no GPU memory on
    the NICs (WEIGHTSYNC_FABRIC_HMEM=0, as on a provider without FI_HMEM). The source is staged through
    pinned slots; the destination is a landing region: tagged messages into its pinned ring, each copied
    to the GPU before its immediate counts. Byte-exact from 1 B to 1 GiB at odd offsets, and a 2-D write.

    First in the module, with half-GPU actors of its own (one GPU is enough: no CUDA IPC here), gone
    before ``pair`` takes whole GPUs."""
    end = ray.remote(num_gpus=0.5)(GpuEnd)
    src, dst = end.remote(), end.remote()
    try:
        ray.get([src.info.remote(), dst.info.remote()], timeout=120)
        ray.get([e.setenv.remote("WEIGHTSYNC_FABRIC_HMEM", "0") for e in (src, dst)])
        ray.get([e.reconfigure.remote(cuda_peers=False) for e in (src, dst)])
        address = ray.get(dst.info.remote())["address"]
        assert ray.get(src.transport_to.remote(address)) == "fabric"
        landed0 = sum(s["landed_bytes"] for s in ray.get(dst.stats.remote()))
        moved = 0
        src_off, dst_off, pad = 5, 4097, 513
        for k, nbytes in enumerate([1, 4095, (16 << 20) + 1, (64 << 20) + 7, GiB]):
            s_id, _ = ray.get(src.alloc.remote(nbytes + src_off, seed=k + 1))
            d_id, d_desc = ray.get(dst.alloc.remote(nbytes + dst_off + pad))
            assert ray.get(dst.landing.remote(d_id)) >= 0, "the destination is not a landing region"
            start = time.perf_counter()
            out = ray.get(src.write.remote(s_id, src_off, address, d_desc, dst_off, nbytes, imm=90 + k,
                                           timeout=120.0))
            ray.get(dst.counter_wait.remote(90 + k, out["imm_count"], 120.0))
            elapsed = time.perf_counter() - start
            result = ray.get(dst.check.remote(d_id, dst_off, nbytes, k + 1, src_off))
            assert result == {"data": True, "before": True, "after": True}, (nbytes, result)
            moved += nbytes
            if nbytes == GiB:
                print(f"GPU -> GPU over fabric TCP through the landing ring: 1 GiB in {elapsed:.3f} s, "
                      f"{nbytes / elapsed / 1e9:.2f} GB/s (submit to last immediate, incl. Ray calls)")
            ray.get([src.free.remote(s_id), dst.free.remote(d_id)])

        rows, row, src_pitch, dst_pitch = 64, (1 << 20) + 3, (1 << 20) + 100, (1 << 20) + 7
        src_len = src_off + (rows - 1) * src_pitch + row + 5
        s_id, _ = ray.get(src.alloc.remote(src_len, seed=77))
        d_id, d_desc = ray.get(dst.alloc.remote(dst_off + (rows - 1) * dst_pitch + row + pad))
        out = ray.get(src.write.remote(s_id, src_off, address, d_desc, dst_off, row, imm=99, repeat=2,
                                       rows=rows, src_pitch=src_pitch, dst_pitch=dst_pitch))
        assert out["imm_count"] == 2  # one immediate per 2-D write, through the landing ring too
        ray.get(dst.counter_wait.remote(99, 2))
        time.sleep(0.2)
        with pytest.raises(ray.exceptions.RayTaskError, match="TimeoutError"):
            ray.get(dst.counter_wait.remote(99, 1, 0.2))  # and not one more
        result = ray.get(dst.check_rows.remote(d_id, dst_off, rows, row, dst_pitch, 77, src_off, src_pitch,
                                               src_len))
        assert result == {"data": True, "outside": True}, result
        moved += 2 * rows * row
        ray.get([src.free.remote(s_id), dst.free.remote(d_id)])

        stats = ray.get(dst.stats.remote())
        assert sum(s["landed_bytes"] for s in stats) - landed0 == moved  # all of it through the ring
        assert sum(s["landing_dropped"] for s in stats) == 0
    finally:
        for e in (src, dst):
            ray.kill(e)


def _host_diagnostics() -> str:
    """What decides whether expandable-segment memory can be shared here (printed on failure)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = f.read().strip()
    except OSError:
        scope = "n/a (no yama)"
    caps = ""
    try:
        with open("/proc/self/status") as f:
            caps = next((line.split()[1] for line in f if line.startswith("CapEff")), "")
    except OSError:
        pass
    return (f"kernel {os.uname().release}, euid {os.geteuid()}, CapEff {caps}, yama ptrace_scope {scope}, "
            f"torch {torch.__version__}")


def test_peer_the_copy_engines_cannot_reach_has_no_failed_path() -> None:
    """An engine with a cuda lane writing to a peer without one (a CPU-memory engine, or one on another
    host) goes over its NICs: that is the peer's lane, not a failure. ``failed_paths`` lists NIC paths
    only, all healthy, before and after writes (it once listed the cuda lane's "not reachable" as a
    failed path, which the landing tests took for a failure on every GPU host: issue 15 case 10)."""
    import numpy as np

    gpu_engine = ws.TransferEngine()  # a cuda lane on this host's GPU, and its NICs
    cpu_engine = ws.TransferEngine(transport="fabric")
    try:
        assert gpu_engine.transport == "fabric+cuda"
        peer = gpu_engine.connect(cpu_engine.address)
        assert peer.lane == "fabric"
        nics = len(peer.failed_paths)
        assert nics >= 1 and peer.failed_paths == [False] * nics
        src = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8)
        dst = np.full(4 << 20, 0xA5, dtype=np.uint8)
        region, target = gpu_engine.register(src), cpu_engine.register(dst)
        t = gpu_engine.write(region, 0, peer, target.descriptor, 0, src.nbytes, imm=7)
        t.wait(30)
        cpu_engine.counter(7).wait(t.imm_count, 30)
        assert bytes(dst) == bytes(src)
        assert peer.failed_paths == [False] * nics and peer.last_error == ""
    finally:
        gpu_engine.close()
        cpu_engine.close()


def test_copy_engine_writes_into_expandable_segments(ray_session) -> None:
    """A destination whose tensors come from PyTorch's expandable segments (CUDA virtual-memory mappings,
    which cuIpcGetMemHandle refuses): the cuda lane exports them as one file descriptor per physical
    allocation, the source duplicates them (pidfd_getfd) and maps them. A tensor spanning several segment
    pages and a small one; writes at odd offsets across page boundaries, byte-exact, the bytes around
    untouched, the immediates counted.

    Second in the module, with two whole-GPU actors of its own, gone before ``pair`` takes its GPUs."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs (this machine has {torch.cuda.device_count()})")
    env = {"PYTHONPATH": ROOT, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    end = ray.remote(num_gpus=1)(GpuEnd)
    src = end.remote()
    dst = end.options(runtime_env={"env_vars": env}).remote()
    diag = _host_diagnostics()
    try:
        _s_info, d_info = ray.get([src.info.remote(), dst.info.remote()], timeout=120)
        address = d_info["address"]
        assert ray.get(src.transport_to.remote(address)) == "cuda", diag

        big_len, small_len = (100 << 20) + 12345, 8191
        try:
            big, big_desc = ray.get(dst.alloc.remote(big_len))
            small, small_desc = ray.get(dst.alloc.remote(small_len))
        except ray.exceptions.RayTaskError as e:
            msg = str(e.cause)
            print("registering expandable-segment memory failed:", msg, "|", diag)
            if "requestedHandleTypes" in msg:  # this PyTorch made them unexportable as fds (fabric handles?)
                pytest.skip(f"expandable segments here are not exportable as file descriptors: {msg[:800]}")
            raise
        infos = ray.get([dst.export_info.remote(big), dst.export_info.remote(small)])
        print("destination exports:", infos, "|", diag)
        for info in infos:
            # The env var took effect and the lane took the VMM path: otherwise the test means nothing.
            assert info["alloc_conf"] == "expandable_segments:True", info
            assert info["vmm"], f"a CUDA IPC handle, not a VMM export (expandable segments off?): {info}"
            if info["segment"] is not None and info["segment"].get("is_expandable") is not None:
                assert info["segment"]["is_expandable"], info
        assert infos[0]["chunks"] >= 5, infos[0]  # 100 MiB over 20 MiB (or 2 MiB) pages

        src_len = (64 << 20) + (1 << 20)
        s_id, _ = ray.get(src.alloc.remote(src_len, seed=130))
        page = 20 << 20
        # (src_off, dst_off, nbytes) into the big tensor: 1 B; 4095 B across the first 20 MiB page
        # boundary (in the tensor; the tensor's own start in its page is wherever the allocator put it);
        # 64 MiB + 3 across three boundaries; 4095 B ending one byte before the tensor's end.
        big_spans = [(7, 1, 1), (11, page - 2001, 4095), (13, page + (5 << 20) + 3, (64 << 20) + 3),
                     (1 << 20, big_len - 4096, 4095)]
        small_spans = [(5, 3, 4095)]
        imm = 130
        waits = []
        for desc, spans in ((big_desc, big_spans), (small_desc, small_spans)):
            for so, do, n in spans:
                try:
                    out = ray.get(src.write.remote(s_id, so, address, desc, do, n, imm=imm, timeout=60.0),
                                  timeout=120)
                except ray.exceptions.RayTaskError as e:
                    msg = str(e.cause)
                    print(f"write of {n} B at {do} failed:", msg, "|", diag)
                    if "ptrace permission" in msg or "lacks pidfd" in msg:
                        pytest.skip(f"this host does not let processes share file descriptors: {msg[:800]} "
                                    f"({diag})")
                    raise
                waits.append((imm, out["imm_count"]))
                imm += 1
        for k, count in waits:
            assert count >= 1
            ray.get(dst.counter_wait.remote(k, count, 60.0), timeout=120)
        time.sleep(0.2)
        for k, _count in waits:
            with pytest.raises(ray.exceptions.RayTaskError, match="TimeoutError"):
                ray.get(dst.counter_wait.remote(k, 1, 0.2))  # and not one more
        for region, spans in ((big, big_spans), (small, small_spans)):
            result = ray.get(dst.check_spans.remote(region, spans, 130, src_len))
            assert result == {"data": True, "outside": True}, (region, spans, result, infos, diag)
        ray.get([src.free.remote(s_id), dst.free.remote(big), dst.free.remote(small)])
    finally:
        for e in (src, dst):
            ray.kill(e)


@pytest.mark.parametrize("nbytes", [1, 4095, 64 << 20, GiB + 3, 8 * GiB])
def test_copy_engine_writes_between_ray_gpu_actors(pair, nbytes: int) -> None:
    src, dst, (_src_info, dst_info) = pair
    assert ray.get(src.transport_to.remote(dst_info["address"])) == "cuda"
    src_off, dst_off, pad = 5, 4097, 513
    s_id, _ = ray.get(src.alloc.remote(nbytes + src_off, seed=nbytes))
    d_id, d_desc = ray.get(dst.alloc.remote(nbytes + dst_off + pad))
    out = ray.get(src.write.remote(s_id, src_off, dst_info["address"], d_desc, dst_off, nbytes, imm=3))
    ray.get(dst.counter_wait.remote(3, out["imm_count"]))
    result = ray.get(dst.check.remote(d_id, dst_off, nbytes, nbytes, src_off))
    assert result == {"data": True, "before": True, "after": True}, result
    ray.get([src.free.remote(s_id), dst.free.remote(d_id)])


def test_handle_that_cannot_be_opened(pair) -> None:
    src, dst, (_s, dst_info) = pair
    s_id, _ = ray.get(src.alloc.remote(4096, seed=1))
    d_id, d_desc = ray.get(dst.alloc.remote(4096))
    fields = msgpack.unpackb(d_desc)
    body = fields[:-1]
    body[7] = bytes(64) + body[7][64:]  # a zeroed IPC handle, with a valid checksum
    import zlib

    forged = msgpack.packb([*body, zlib.crc32(msgpack.packb(body, use_bin_type=True))], use_bin_type=True)
    with pytest.raises(ray.exceptions.RayTaskError, match="CUDA IPC handle"):
        ray.get(src.write.remote(s_id, 0, dst_info["address"], forged, 0, 4096))
    # The engine keeps working for the genuine descriptor.
    out = ray.get(src.write.remote(s_id, 0, dst_info["address"], d_desc, 0, 4096, imm=4))
    ray.get(dst.counter_wait.remote(4, out["imm_count"]))
    assert ray.get(dst.check.remote(d_id, 0, 4096, 1, 0))["data"]


# (rows, row bytes, source pitch, destination pitch): strided both sides at odd sizes; pitches past the
# copy engines' 2-D limit (the lane then copies row by row); more rows than one 2-D copy takes; rows
# back to back (one span, cut into cuda_piece copies); big rows.
TWO_D = [
    (7, 100, 1000, 333),
    (2, 4097, (2 << 30) + 7, 5000),
    (70_000, 3, 5, 7),
    (96, 1 << 20, 1 << 20, 1 << 20),
    (5, (64 << 20) + 1, (65 << 20), (64 << 20) + 3),
]


@pytest.mark.parametrize(("rows", "row_bytes", "src_pitch", "dst_pitch"), TWO_D)
def test_2d_writes_between_ray_gpu_actors(pair, rows: int, row_bytes: int, src_pitch: int,
                                          dst_pitch: int) -> None:
    src, dst, (_s, dst_info) = pair
    src_off, dst_off, pad = 3, 4097, 77
    src_len = src_off + (rows - 1) * src_pitch + row_bytes + 5
    s_id, _ = ray.get(src.alloc.remote(src_len, seed=rows))
    d_id, d_desc = ray.get(dst.alloc.remote(dst_off + (rows - 1) * dst_pitch + row_bytes + pad))
    out = ray.get(src.write.remote(s_id, src_off, dst_info["address"], d_desc, dst_off, row_bytes, imm=40,
                                   repeat=2, rows=rows, src_pitch=src_pitch, dst_pitch=dst_pitch))
    assert out["imm_count"] == 2  # one immediate per 2-D write, on the cuda lane too
    ray.get(dst.counter_wait.remote(40, 2))
    time.sleep(0.2)
    with pytest.raises(ray.exceptions.RayTaskError, match="TimeoutError"):
        ray.get(dst.counter_wait.remote(40, 1, 0.2))  # and not one more
    result = ray.get(dst.check_rows.remote(d_id, dst_off, rows, row_bytes, dst_pitch, rows, src_off,
                                           src_pitch, src_len))
    assert result == {"data": True, "outside": True}, result
    ray.get([src.free.remote(s_id), dst.free.remote(d_id)])


@pytest.mark.parametrize(("piece", "streams"), [(1 << 20, 3), (0, 1), ((7 << 20) + 4096, 2)])
def test_copy_size_and_streams_settings(pair, piece: int, streams: int) -> None:
    """However the cuda lane cuts a write into copies, the bytes land exactly and the destination counts
    the engine's imm_count (the fabric rule), all delivered after the last copy."""
    src, dst, (_s, dst_info) = pair
    ray.get(src.reconfigure.remote(cuda_piece=piece, cuda_streams=streams))
    try:
        n = (37 << 20) + 5
        s_id, _ = ray.get(src.alloc.remote(n + 3, seed=50))
        d_id, d_desc = ray.get(dst.alloc.remote(n + 4097 + 9))
        out = ray.get(src.write.remote(s_id, 3, dst_info["address"], d_desc, 4097, n, imm=60, repeat=3))
        assert out["imm_count"] == 3 * ray.get(src.imm_count.remote(n))
        ray.get(dst.counter_wait.remote(60, out["imm_count"]))
        result = ray.get(dst.check.remote(d_id, 4097, n, 50, 3))
        assert result == {"data": True, "before": True, "after": True}, result
        ray.get(dst.free.remote(d_id))
        # A 2-D block cut into copies of whole rows: still one immediate.
        rows, row, pitch = 300, 100_003, 100_100
        d_id, d_desc = ray.get(dst.alloc.remote(rows * pitch))
        out = ray.get(src.write.remote(s_id, 0, dst_info["address"], d_desc, 0, row, imm=61, rows=rows,
                                       src_pitch=row, dst_pitch=pitch))
        assert out["imm_count"] == 1
        ray.get(dst.counter_wait.remote(61, 1))
        result = ray.get(dst.check_rows.remote(d_id, 0, rows, row, pitch, 50, 0, row, n + 3))
        assert result == {"data": True, "outside": True}, result
        ray.get([src.free.remote(s_id), dst.free.remote(d_id)])
    finally:
        ray.get(src.reconfigure.remote())


@pytest.mark.parametrize("batch_bytes", [64 << 20, 1 << 20, 0])
def test_many_writes_batched_or_not(pair, batch_bytes: int) -> None:
    """One write_batch of 2,000 1-D writes (1 B to 3 MiB, odd offsets) with 2-D writes among them: the
    cuda lane sends runs of small 1-D copies as batched copies of at most ``cuda_batch_bytes`` (a 2-D
    write or a large one closes the run), or one call per copy with 0. Every byte lands exactly, nothing
    between the writes is touched, and the destination counts exactly the writes' immediates."""
    src, dst, (_s, dst_info) = pair
    ray.get(src.reconfigure.remote(cuda_batch_bytes=batch_bytes))
    try:
        rng = random.Random(batch_bytes + 7)
        n, src_len = 2000, 96 << 20
        ops: list[tuple[int, int, int, int, int, int]] = []
        spans: list[tuple[int, int, int]] = []
        at = 5
        for k in range(n):
            if k % 97 == 50:  # a 2-D block: 40 rows of 1,000 B, pitch 1,024 on both sides
                so = rng.randrange(0, src_len - 41 * 1024)
                ops.append((so, at, 1000, 40, 1024, 1024))
                spans += [(so + r * 1024, at + r * 1024, 1000) for r in range(40)]
                at += 40 * 1024 + 3
                continue
            size = rng.choice([1, 7, 4096, 65_537, 300_001]) if k % 250 else 3 << 20
            so = rng.randrange(0, src_len - size)
            ops.append((so, at, size, 1, size, size))
            spans.append((so, at, size))
            at += size + rng.randrange(1, 64)  # gaps: poison in between must stay
        s_id, _ = ray.get(src.alloc.remote(src_len, seed=140))
        d_id, d_desc = ray.get(dst.alloc.remote(at + 11))
        out = ray.get(src.write_batch.remote(s_id, dst_info["address"], d_desc, ops, 70))
        want = sum(ray.get([src.imm_count.remote(row, rows=rows) for _so, _do, row, rows, _sp, _dp in ops]))
        assert out["imm_count"] == want
        ray.get(dst.counter_wait.remote(70, want))
        time.sleep(0.2)
        with pytest.raises(ray.exceptions.RayTaskError, match="TimeoutError"):
            ray.get(dst.counter_wait.remote(70, 1, 0.2))  # and not one more
        result = ray.get(dst.check_spans.remote(d_id, spans, 140, src_len))
        assert result == {"data": True, "outside": True}, result
        ray.get([src.free.remote(s_id), dst.free.remote(d_id)])
    finally:
        ray.get(src.reconfigure.remote())


def test_write_into_deregistered_gpu_region_is_refused(pair) -> None:
    """The destination deregistered the region (and could reuse its memory): the writer checks the
    destination's live table before each copy and fails with an error naming the region."""
    src, dst, (_s, dst_info) = pair
    s_id, _ = ray.get(src.alloc.remote(1 << 20, seed=21))
    d_id, d_desc = ray.get(dst.alloc.remote(1 << 20))
    out = ray.get(src.write.remote(s_id, 0, dst_info["address"], d_desc, 0, 1 << 20, imm=21))
    ray.get(dst.counter_wait.remote(21, out["imm_count"]))
    ray.get(dst.deregister.remote(d_id))
    for geometry in ({}, {"rows": 4, "dst_pitch": 1 << 18, "src_pitch": 1 << 18}):
        nbytes = 1 << 20 if not geometry else 1000
        with pytest.raises(ray.exceptions.RayTaskError, match=r"region \d+ of .* deregistered"):
            ray.get(src.write.remote(s_id, 0, dst_info["address"], d_desc, 0, nbytes, imm=22, **geometry))
    assert ray.get(dst.untouched.remote(d_id))
    # The same pair keeps working for a live region.
    e_id, e_desc = ray.get(dst.alloc.remote(1 << 20))
    out = ray.get(src.write.remote(s_id, 0, dst_info["address"], e_desc, 0, 1 << 20, imm=23))
    ray.get(dst.counter_wait.remote(23, out["imm_count"]))
    assert ray.get(dst.check.remote(e_id, 0, 1 << 20, 21, 0))["data"]


def test_gpu_source_to_host_region_over_fabric(pair) -> None:
    """A host destination has no IPC handle, so GPU memory reaches it over a fabric NIC: straight where
    the provider has FI_HMEM, else through the pinned staging slots (device-to-host copy, then write)."""
    src, dst, (_s, dst_info) = pair
    n = (40 << 20) + 3
    s_id, _ = ray.get(src.alloc.remote(n + 5, seed=70))
    h_id, h_desc = ray.get(dst.alloc_host.remote(n + 4096 + 9))
    before = sum(s["bytes"] for s in ray.get(src.stats.remote())[:-1])
    out = ray.get(src.write.remote(s_id, 5, dst_info["address"], h_desc, 4096, n, imm=80, repeat=2))
    ray.get(dst.counter_wait.remote(80, out["imm_count"]))
    result = ray.get(dst.check.remote(h_id, 4096, n, 70, 5))
    assert result == {"data": True, "before": True, "after": True}, result
    fabric_bytes = sum(s["bytes"] for s in ray.get(src.stats.remote())[:-1]) - before
    assert fabric_bytes == 2 * n  # over the NICs, not the copy engines
    ray.get([src.free.remote(s_id), dst.free.remote(h_id)])


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="a relay chain needs 3 GPUs")
def test_relay_chain_over_the_cuda_lane(pair) -> None:
    """A -> B -> C on three GPUs: B's engine forwards each chunk to C from its cuda worker as soon as
    the chunk's immediates from A are in (issue #8's relay), byte-exact on C."""
    src, dst, (_s, b_info) = pair
    c = ray.remote(num_gpus=1)(GpuEnd).remote()
    try:
        c_info = ray.get(c.info.remote(), timeout=120)
        sizes = [1, 4095, (3 << 20) + 7, 64 << 20, (100 << 20) + 5]
        offs = [3 + sum(sizes[:k]) for k in range(len(sizes))]
        total = offs[-1] + sizes[-1]
        s_id, _ = ray.get(src.alloc.remote(total, seed=90))
        b_id, b_desc = ray.get(dst.alloc.remote(total))
        c_id, c_desc = ray.get(c.alloc.remote(total + 64))
        expected = 0
        for k, (off, size) in enumerate(zip(offs, sizes, strict=True)):
            count = ray.get(src.imm_count.remote(size))
            expected += ray.get(dst.forward.remote(100 + k, count, b_id, off, c_info["address"], c_desc,
                                                   off + 64, size, 200))
        for k in reversed(range(len(sizes))):
            ray.get(src.write.remote(s_id, offs[k], b_info["address"], b_desc, offs[k], sizes[k],
                                     imm=100 + k))
        ray.get(c.counter_wait.remote(200, expected))
        assert ray.get(dst.forward_wait.remote()) == len(sizes)
        body = total - offs[0]
        result = ray.get(c.check.remote(c_id, 64 + offs[0], body, 90, offs[0]))
        assert result == {"data": True, "before": True, "after": True}, result
        ray.get([src.free.remote(s_id), dst.free.remote(b_id)])
    finally:
        ray.kill(c)


def test_destination_actor_that_died(pair) -> None:
    """Runs last in the module: it kills the shared destination, then checks the source still works."""
    src, dst, (_s, dst_info) = pair
    s_id, _ = ray.get(src.alloc.remote(1 << 20, seed=2))
    _d_id, d_desc = ray.get(dst.alloc.remote(1 << 20))
    ray.get(src.write.remote(s_id, 0, dst_info["address"], d_desc, 0, 1 << 20, imm=5))
    ray.kill(dst, no_restart=True)
    time.sleep(2)  # let the process go
    start = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError) as info_exc:
        for _ in range(3):
            ray.get(src.write.remote(s_id, 0, dst_info["address"], d_desc, 0, 1 << 20, imm=5, timeout=20.0),
                    timeout=60)
    print("error for the dead destination:", str(info_exc.value.cause)[:300])
    assert isinstance(info_exc.value.cause, ws.WeightSyncError)
    assert time.monotonic() - start < 70

    # The engine keeps working for other peers: a new destination on the freed GPU.
    fresh = ray.remote(num_gpus=1)(GpuEnd).remote()
    info = ray.get(fresh.info.remote(), timeout=120)
    d_id, d_desc = ray.get(fresh.alloc.remote(1 << 20))
    out = ray.get(src.write.remote(s_id, 0, info["address"], d_desc, 0, 1 << 20, imm=6))
    ray.get(fresh.counter_wait.remote(6, out["imm_count"]))
    assert ray.get(fresh.check.remote(d_id, 0, 1 << 20, 2, 0))["data"]
    ray.kill(fresh)


def test_two_processes_on_one_gpu(pair) -> None:
    src, _dst, _info = pair
    ray.kill(src)  # frees a whole GPU for two half-GPU actors
    half = ray.remote(num_gpus=0.5)(GpuEnd)
    a, b = half.remote(), half.remote()
    ia, ib = ray.get([a.info.remote(), b.info.remote()], timeout=120)
    assert ia["uuid"] == ib["uuid"], "Ray placed the two half-GPU actors on different GPUs"
    n = (64 << 20) + 7
    s_id, _ = ray.get(a.alloc.remote(n + 3, seed=11))
    d_id, d_desc = ray.get(b.alloc.remote(n + 100))
    assert ray.get(a.transport_to.remote(ib["address"])) == "cuda"
    out = ray.get(a.write.remote(s_id, 3, ib["address"], d_desc, 50, n, imm=8))
    ray.get(b.counter_wait.remote(8, out["imm_count"]))
    assert ray.get(b.check.remote(d_id, 50, n, 11, 3)) == {"data": True, "before": True, "after": True}
