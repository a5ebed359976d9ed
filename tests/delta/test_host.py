"""The delta push's C++ host kernels (cpp/delta/, weightsync/delta/host.py) against torch, bit for
bit: the compare's positions, values and reference update for every word size (random data, never zeros;
NaN payloads, -0.0, denormals; the first and last word of every key; keys of odd lengths at unaligned
addresses; nothing and everything changed; room for fewer changes than there are, one and several
threads), the ENC_IDX16 scatter against torch's indexed copy, and the errors a bad argument or a corrupt
stream raise. Output buffers are filled with a poison byte first: an entry left unwritten shows."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.delta_paths import push_both_ways
from weightsync._ext import _core
from weightsync.delta import host as delta_host
from weightsync.delta.codec import ENC_BITMAP, ENC_IDX16, _values_at, encode_into, sparse_sizes
from weightsync.delta.units import BLOCK, _align

INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
FLOATS = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}
POISON = 0xA5
# The kernels give a thread at least 2**18 words: spaces this big are compared on two or more.
THREAD_WORDS = 1 << 18


def _random_words(n: int, w: int, g: torch.Generator) -> torch.Tensor:
    """``n`` random ``w``-byte words, none of them zero (a zero-filled buffer hides unwritten bytes)."""
    t = torch.randint(0, 256, (n * w,), dtype=torch.uint8, generator=g).view(INTS[w])
    t[t == 0] = 1
    return t


def _specials(cur: torch.Tensor, ref: torch.Tensor, w: int) -> None:
    """Float bit patterns that ``==`` gets wrong, set at a few places of ``cur`` (current) and ``ref``:
    -0.0 against 0.0 (equal as floats: must be found), the same NaN in both (unequal as floats: must
    not be found), NaNs of different payloads (must be found), denormals differing in their last bit."""
    if w not in FLOATS or cur.numel() < 8:
        return
    fc, fr = cur.view(FLOATS[w]), ref.view(FLOATS[w])
    fc[0], fr[0] = -0.0, 0.0
    fc[1], fr[1] = float("nan"), float("nan")  # bitwise equal: unchanged
    fc[2], fr[2] = float("nan"), float("nan")
    cur[2] ^= 1 << 1  # another NaN payload
    tiny = torch.finfo(FLOATS[w]).tiny
    fc[3], fr[3] = tiny / 4, tiny / 4
    cur[3] ^= 1  # a denormal one bit away


def _space(sizes: list[int], w: int, frac: float,
           g: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Keys of ``sizes`` words (current values) and a reference that differs from them at about ``frac``
    of the words, always at each key's first and last word (``frac`` 0: none), with the float specials in
    the first key unless none or all changed."""
    keys, refs = [], []
    for n in sizes:
        cur = _random_words(n, w, g)
        ref = cur.clone()
        if n:
            flip = torch.rand(n, generator=g) < frac
            flip[0] = flip[-1] = frac > 0
            ref[flip] ^= _random_words(int(flip.sum()), w, g)  # nonzero: really a change
        keys.append(cur)
        refs.append(ref)
    if 0 < frac < 1:
        _specials(keys[0], refs[0], w)
    return keys, torch.cat(refs)


def _expected(keys: list[torch.Tensor], ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cur = torch.cat(keys)
    idx = torch.nonzero(cur != ref).reshape(-1)
    return idx, cur[idx]


def _unaligned(keys: list[torch.Tensor], offset: int) -> tuple[list[torch.Tensor], list[int]]:
    """Copies of ``keys`` at ``offset`` bytes past a 64-byte boundary (the tensors keep the storage
    alive; the addresses are what the kernel reads)."""
    held, addrs = [], []
    for k in keys:
        nbytes = int(k.numel()) * k.element_size()
        buf = torch.empty(nbytes + 128, dtype=torch.uint8)
        start = (-int(buf.data_ptr())) % 64 + offset
        buf[start:start + nbytes].copy_(k.view(torch.uint8))
        held.append(buf)
        addrs.append(int(buf.data_ptr()) + start)
    return held, addrs


def _raw_compare(w: int, ref: torch.Tensor, addrs: list[int], sizes: list[int], cap: int,
                 threads: int, scratch_entries: int = 0) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The compare with poisoned outputs; ``scratch_entries``: a poisoned scratch with room for that many
    changes per thread after the first (0: none, the kernel's own memory)."""
    out_idx = torch.empty(max(cap, 1), dtype=torch.int64)
    out_val = torch.empty(max(cap, 1), dtype=INTS[w])
    out_idx.view(torch.uint8).fill_(POISON)
    out_val.view(torch.uint8).fill_(POISON)
    nbytes = (threads - 1) * (scratch_entries * (8 + 2 * w) + 8) if scratch_entries else 0
    scratch = torch.full((max(nbytes, 1),), POISON, dtype=torch.uint8)
    k = _core.delta_compare(w, int(ref.data_ptr()), int(ref.numel()), np.array(addrs, np.uint64),
                            np.array(sizes, np.int64), int(out_idx.data_ptr()), int(out_val.data_ptr()), cap,
                            threads, int(scratch.data_ptr()) if nbytes else 0, nbytes)
    return int(k), out_idx, out_val


SIZES = [37, 1, 0, 4099, 255, 257, 3]  # odd lengths, an empty key, tails of every size


@pytest.mark.parametrize("w", [1, 2, 4, 8])
@pytest.mark.parametrize("frac", [0.0, 0.003, 0.05, 1.0])
def test_compare_matches_torch_on_keys_at_odd_addresses(w: int, frac: float) -> None:
    g = torch.Generator().manual_seed(w * 100 + int(frac * 1000))
    keys, ref = _space(SIZES, w, frac, g)
    idx, vals = _expected(keys, ref)
    if frac == 1.0:  # every word differs (the random flips are nonzero)
        assert idx.numel() == ref.numel()
    if frac == 0.0:
        assert idx.numel() == 0
    for offset in (0, 1, 2 * w + 1, 3):  # whole words off, and byte addresses no word is at
        r = ref.clone()
        held, addrs = _unaligned(keys, offset)
        k, oi, ov = _raw_compare(w, r, addrs, SIZES, int(ref.numel()), 1)
        assert k == idx.numel(), (offset, k, idx.numel())
        assert torch.equal(oi[:k], idx), offset
        assert torch.equal(ov[:k], vals), offset
        assert torch.equal(r, torch.cat(keys)), offset  # the reference is the keys now
        del held


@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_compare_through_the_face_with_room_for_fewer(w: int) -> None:
    """delta_host.compare: word views at whole-word offsets from 16 bytes; a hint of 1 (room for 1024
    changes) against thousands: the second run finds the rest and the outputs concatenate."""
    g = torch.Generator().manual_seed(w)
    sizes = [70001, 13, 30007]
    keys, ref = _space(sizes, w, 0.07, g)
    idx, vals = _expected(keys, ref)
    assert idx.numel() > 4 * 1024
    base = torch.empty(sum(sizes) + 3 * len(sizes), dtype=INTS[w])
    views, at = [], 1  # key j at word 1 + j of a gap: never 16-byte aligned for w < 16
    for k in keys:
        views.append(base[at:at + k.numel()])
        views[-1].copy_(k)
        at += k.numel() + 1
    got_idx, got_vals = delta_host.compare(views, ref, hint=1, poison=POISON)
    assert torch.equal(got_idx, idx)
    assert torch.equal(got_vals, vals)
    assert torch.equal(ref, torch.cat(keys))


@pytest.mark.parametrize("scratch", [0, 4096, 1 << 16])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("w", [1, 2, 8])
def test_room_for_fewer_writes_exactly_the_first_and_a_second_run_the_rest(w: int, threads: int,
                                                                           scratch: int) -> None:
    """cap below the count, on one thread and on several (the cap falling in a later thread's range, whose
    changes were put into the reference before the counts were known and must be taken back); the later
    threads' changes in the caller's scratch (room for all of them, or for 4096 each: then grown into the
    heap span way) or in the kernel's own memory."""
    g = torch.Generator().manual_seed(10 * w + threads)
    sizes = [THREAD_WORDS * 2 + 17, 5, THREAD_WORDS + 3]
    keys, ref = _space(sizes, w, 0.05, g)
    idx, vals = _expected(keys, ref)
    total = int(idx.numel())
    assert total > 2 * 4096 * threads  # each thread finds more than 4096
    addrs = [int(k.data_ptr()) for k in keys]
    for cap in (0, 1, total // 3, total - 1, total, total + 5):
        r = ref.clone()
        k, oi, ov = _raw_compare(w, r, addrs, sizes, cap, threads, scratch)
        assert k == total, cap
        m = min(cap, total)
        assert torch.equal(oi[:m], idx[:m]), cap
        assert torch.equal(ov[:m], vals[:m]), cap
        # the reference took exactly the first m changes
        want = ref.clone()
        want[idx[:m]] = vals[:m]
        assert torch.equal(r, want), cap
        if m < total:
            k2, oi2, ov2 = _raw_compare(w, r, addrs, sizes, total - m, threads, scratch)
            assert k2 == total - m, cap
            assert torch.equal(torch.cat([oi[:m], oi2[:k2]]), idx), cap
            assert torch.equal(torch.cat([ov[:m], ov2[:k2]]), vals), cap
        assert torch.equal(r, torch.cat(keys)), cap


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("frac", [0.0, 0.02, 1.0])
def test_threads_split_the_space_and_place_their_changes_in_order(frac: float, threads: int) -> None:
    g = torch.Generator().manual_seed(threads)
    sizes = [THREAD_WORDS + 1, 3, THREAD_WORDS * 2 - 1, 1000]
    keys, ref = _space(sizes, 2, frac, g)
    idx, vals = _expected(keys, ref)
    k, oi, ov = _raw_compare(2, ref, [int(t.data_ptr()) for t in keys], sizes, int(ref.numel()), threads)
    assert k == idx.numel()
    assert torch.equal(oi[:k], idx)
    assert torch.equal(ov[:k], vals)
    assert torch.equal(ref, torch.cat(keys))


def test_a_space_keeps_its_buffers_from_push_to_push() -> None:
    """SpaceCompare: each compare right (outputs poisoned first), the buffers the same memory from one
    compare to the next while big enough, new ones when the changes outgrow them."""
    g = torch.Generator().manual_seed(9)
    sizes = [THREAD_WORDS * 2 + 5, 77]
    keys, ref = _space(sizes, 2, 0.0, g)
    space = delta_host.SpaceCompare()
    space.poison = POISON
    held = None
    hint = 0
    for step, frac in enumerate([0.02, 0.02, 0.015, 0.2, 0.0]):
        for k in keys:
            flip = torch.rand(k.numel(), generator=g) < frac
            k[flip] ^= _random_words(int(flip.sum()), 2, g)
        idx, vals = _expected(keys, ref)
        got_idx, got_vals = space.compare(keys, ref, hint, nthreads=2)
        assert torch.equal(got_idx, idx), step
        assert torch.equal(got_vals, vals), step
        assert torch.equal(ref, torch.cat(keys)), step
        ptrs = (space.out_idx.data_ptr(), space.out_val.data_ptr(), space.scratch.data_ptr())
        if step in (2, 3):  # room enough from the step before (steps 0 and 1 outgrew theirs): the same memory
            assert ptrs == held, step
        if step == 4:  # outgrown at step 3 (20% changed): new ones
            assert ptrs[0] != held[0], step
        hint = int(idx.numel()) * 9 // 8
        held = ptrs
    assert space.scratch_bytes == sum(t.numel() * t.element_size()
                                      for t in (space.out_idx, space.out_val, space.scratch))


def test_compare_refuses_bad_arguments() -> None:
    ref = torch.zeros(64, dtype=torch.int16)
    key = torch.ones(64, dtype=torch.int16)
    oi, ov = torch.empty(64, dtype=torch.int64), torch.empty(64, dtype=torch.int16)
    a = np.array([key.data_ptr()], np.uint64)

    def call(**kw: Any) -> int:
        args = {"word": 2, "ref": ref.data_ptr(), "ref_words": 64, "addrs": a, "words": np.array([64]),
                "out_idx": oi.data_ptr(), "out_val": ov.data_ptr(), "cap": 64, "threads": 1, **kw}
        return _core.delta_compare(**args)

    assert call() == 64  # the arguments below are bad one at a time
    ref.zero_()
    for kw, what in [({"word": 3}, "word must be"), ({"ref": ref.data_ptr() + 1}, "not aligned"),
                     ({"ref": 0}, "reference is null"), ({"out_idx": oi.data_ptr() + 4}, "out_idx"),
                     ({"out_val": ov.data_ptr() + 1}, "out_val"), ({"out_idx": 0}, "null"),
                     ({"words": np.array([63])}, "63 words, the reference 64"),
                     ({"words": np.array([65])}, "more words than the reference"),
                     ({"addrs": np.array([0], np.uint64)}, "address is null"),
                     ({"addrs": np.array([ref.data_ptr() + 2], np.uint64)}, "overlaps the reference"),
                     ({"out_val": ref.data_ptr()}, "overlap"), ({"cap": -1}, "cap"),
                     ({"threads": 0}, "threads"),
                     ({"words": np.array([64, 0])}, "differ in length"),
                     ({"scratch": oi.data_ptr() + 4, "scratch_bytes": 64}, "8-byte aligned"),
                     ({"scratch": 0, "scratch_bytes": 64}, "null and empty"),
                     ({"scratch": oi.data_ptr(), "scratch_bytes": -8}, "null and empty"),
                     ({"scratch": ref.data_ptr(), "scratch_bytes": 64}, "scratch overlaps")]:
        with pytest.raises(ValueError, match=what):
            call(**kw)
    assert torch.equal(ref, torch.zeros(64, dtype=torch.int16))  # none of them touched it
    with pytest.raises(ValueError, match="not contiguous"):
        delta_host.compare([key[::2]], ref[:32], 0)
    with pytest.raises(ValueError, match="the reference 64"):
        delta_host.compare([key[:10]], ref, 0)


# -- the scatter -----------------------------------------------------------------------------------------
def _stream(n: int, idx: torch.Tensor, vals: torch.Tensor, w: int,
            enc: int = ENC_IDX16) -> tuple[torch.Tensor, int]:
    """A stream (ENC_IDX16 or ENC_BITMAP) of changed words ``idx`` of ``n`` (uint8, poisoned past its end)
    and where its values start."""
    k = int(idx.numel())
    size = sparse_sizes(n, k, w)[enc]
    buf = torch.full((size + 64,), POISON, dtype=torch.uint8)
    encode_into(buf[:size], enc, idx, vals, n)
    return buf, _values_at(enc, n, k)


@pytest.mark.parametrize("w", [1, 2, 4, 8])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("enc", [ENC_IDX16, ENC_BITMAP])
def test_scatter_matches_torchs_indexed_copy(w: int, threads: int, enc: int) -> None:
    """A stream over three keys' words laid end to end (the middle key's words placed at an offset in
    its buffer, so its shift is not the stream's), several blocks of 65536 words, some empty: each
    key's buffer after the scatter equals torch's indexed copy of the same changes. The changes are the
    stream's only when the blocks' counts (a bitmap's: its bits), the low bits and the values all land
    right."""
    g = torch.Generator().manual_seed(w + 10 * threads + enc)
    sizes, offsets = [BLOCK + 7, 3 * BLOCK + 1, 999], [0, 5, 0]
    n = sum(sizes)
    # several threads take 65536 entries each at least: so many changes where two are to run
    changed = torch.rand(n, generator=g) < (0.03 if threads == 1 else 0.6)
    changed[BLOCK + 7 + BLOCK:BLOCK + 7 + 2 * BLOCK] = False  # an empty block
    changed[0] = changed[-1] = True
    idx = torch.nonzero(changed).reshape(-1)
    vals = _random_words(int(idx.numel()), w, g)
    stream, vals_at = _stream(n, idx, vals, w, enc)
    bufs = [_random_words(s + o + 3, w, g) for s, o in zip(sizes, offsets, strict=True)]
    want = [b.clone() for b in bufs]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    cut = torch.searchsorted(idx, torch.from_numpy(starts)).tolist()
    runs, key_bytes = [], []
    for j, (b, o) in enumerate(zip(bufs, offsets, strict=True)):
        a0, a1 = int(starts[j]), int(starts[j + 1])
        sel = idx[cut[j]:cut[j + 1]]
        want[j][sel - a0 + o] = vals[cut[j]:cut[j + 1]]
        runs.append((int(b.data_ptr()), o - a0, cut[j], cut[j + 1], a0, a1))
        key_bytes.append(int(b.numel()) * w)
    scatter = delta_host.scatter_idx16 if enc == ENC_IDX16 else delta_host.scatter_bitmap
    done = scatter(stream, n, int(idx.numel()), w, vals_at, runs, key_bytes, threads)
    assert done == "host"
    for j in range(len(bufs)):
        assert torch.equal(bufs[j], want[j]), j


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_bitmap_read_as_16_bit_indices_equals_the_idx16_encoding(threads: int) -> None:
    """``delta_bitmap_to_idx16`` of a bitmap stream gives the block counts and low bits the ENC_IDX16
    encoding of the same changes holds, on one thread or split into whole blocks on several: 40 blocks
    and a short one (n not a multiple of 8), an empty block, a full one, the first and last word."""
    g = torch.Generator().manual_seed(threads)
    n = 40 * BLOCK + 13
    changed = torch.rand(n, generator=g) < 0.1
    changed[3 * BLOCK:4 * BLOCK] = False
    changed[7 * BLOCK:8 * BLOCK] = True
    changed[0] = changed[-1] = True
    idx = torch.nonzero(changed).reshape(-1)
    k = int(idx.numel())
    vals = _random_words(k, 2, g)
    bitmap, _ = _stream(n, idx, vals, 2, ENC_BITMAP)
    want, _ = _stream(n, idx, vals, 2, ENC_IDX16)
    nb = -(-n // BLOCK)
    counts = np.full(nb, -1, np.int32)
    low = np.full(k, 0xA5A5, np.uint16)
    at = (int(bitmap.data_ptr()), n, k, int(counts.ctypes.data), int(low.ctypes.data))
    _core.delta_bitmap_to_idx16(*at, threads)
    o = _align(4 * nb)
    assert np.array_equal(counts, want[:4 * nb].view(torch.int32).numpy())
    assert np.array_equal(low, want[o:o + 2 * k].view(torch.int16).numpy().view(np.uint16))
    with pytest.raises(ValueError, match="threads must be"):
        _core.delta_bitmap_to_idx16(*at, 0)


def test_the_bitmap_encode_on_cpu_equals_the_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's ENC_BITMAP index section set by C++ (``delta_bitmap_set``, the CPU path of the index
    writer) equals the one the torch ops write, byte for byte, from pieces of int64 and int32 positions
    with shifts, the buffers poisoned first; a position outside the stream is refused and sets nothing."""
    from weightsync.delta.codec import _IndexWriter

    g = torch.Generator().manual_seed(9)
    n = 5 * BLOCK + 3
    idx = torch.nonzero(torch.rand(n, generator=g) < 0.2).reshape(-1)
    k = int(idx.numel())
    size = sparse_sizes(n, k, 2)[ENC_BITMAP]
    outs = []
    for kernels in ("1", "0"):
        monkeypatch.setenv(delta_host.ENV, kernels)
        out = torch.full((size,), POISON, dtype=torch.uint8)
        index = _IndexWriter(out, ENC_BITMAP, n, k, torch.device("cpu"))
        assert index.host == (kernels == "1")
        a, b = k // 3, 2 * k // 3
        index.add(idx[:a], 0)
        index.add((idx[a:b] - 100).to(torch.int32), 100)
        index.add(idx[b:] + 7, -7)
        index.close()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    monkeypatch.setenv(delta_host.ENV, "1")
    bits = torch.zeros(-(-n // 8), dtype=torch.uint8)
    pos = torch.tensor([0, 5, n], dtype=torch.int64)
    with pytest.raises(ValueError, match="outside the bitmap's"):
        _core.delta_bitmap_set(int(bits.data_ptr()), n, int(pos.data_ptr()), 3, 0)
    with pytest.raises(ValueError, match="outside the bitmap's"):
        _core.delta_bitmap_set(int(bits.data_ptr()), n, int(pos.data_ptr()), 2, -1)
    assert not bits.any()


def test_a_bitmap_that_sets_other_bits_than_its_count_is_refused() -> None:
    """A bitmap stream is scattered only where its bits below ``n`` are exactly the ``k`` its header
    counts: one bit more, one less, or one set past the stream's last word (in the last byte's spare
    bits) is refused before any key is touched; its runs are checked as an ENC_IDX16 stream's are."""
    w, n = 2, 2 * BLOCK + 5  # the last byte has 3 spare bits
    g = torch.Generator().manual_seed(4)
    idx = torch.tensor([0, 7, BLOCK + 3, n - 1])
    vals = _random_words(4, w, g)
    key = torch.zeros(n, dtype=torch.int16)
    addr = int(key.data_ptr())
    stream, vals_at = _stream(n, idx, vals, w, ENC_BITMAP)

    def scatter(s: torch.Tensor, k: int = 4, run: tuple[int, ...] = (addr, 0, 0, 4, 0, n)) -> None:
        delta_host.scatter_bitmap(s, n, k, w, vals_at, [run], [n * w])

    for bad, k, why in [(1 << 2, 4, "sets 5 bits"), (1 << 0, 4, "sets 3 bits")]:
        s = stream.clone()
        s[0] ^= bad  # word 2 set, or word 0 cleared
        with pytest.raises(ValueError, match=why):
            scatter(s, k)
    s = stream.clone()
    s[(n - 1) // 8] |= 1 << 7  # a spare bit past word n - 1: not a word of the stream
    with pytest.raises(ValueError, match="sets 4 bits below"):
        scatter(s, 5)
    with pytest.raises(ValueError, match="does not fit"):
        delta_host.scatter_bitmap(stream[:20], n, 4, w, vals_at, [], [])
    assert not key.any()
    with pytest.raises(ValueError, match="outside the run"):
        scatter(stream, run=(addr, 0, 0, 4, 0, n - 1))
    key.zero_()
    scatter(stream)
    assert torch.equal(key[idx], vals)


def test_scatter_refuses_a_corrupt_stream_and_bad_runs() -> None:
    w, n = 2, 3 * BLOCK
    g = torch.Generator().manual_seed(3)
    idx = torch.tensor([5, BLOCK + 9, 2 * BLOCK + 100, n - 1])
    vals = _random_words(4, w, g)
    key = torch.zeros(n, dtype=torch.int16)
    addr = int(key.data_ptr())

    def scatter(stream: torch.Tensor, runs: list[tuple[int, ...]], nbytes: int = n * w) -> None:
        delta_host.scatter_idx16(stream, n, 4, w, _values_at(ENC_IDX16, n, 4), runs, [nbytes] * len(runs))

    stream, _ = _stream(n, idx, vals, w)
    scatter(stream, [(addr, 0, 0, 4, 0, n)])
    assert torch.equal(key[idx], vals)
    key.zero_()
    with pytest.raises(ValueError, match="outside the run"):  # the run claims fewer positions
        scatter(stream, [(addr, 0, 0, 4, 0, n - 1)])
    with pytest.raises(ValueError, match="outside the run"):  # a shift past the key's end
        scatter(stream, [(addr, 10, 0, 4, 0, n)])
    with pytest.raises(ValueError, match="outside the run"):  # a key smaller than the run's targets
        scatter(stream, [(addr, 0, 0, 4, 0, n)], nbytes=2 * BLOCK * w)
    with pytest.raises(ValueError, match="takes entries"):
        scatter(stream, [(addr, 0, 0, 5, 0, n)])
    with pytest.raises(ValueError, match="spans stream positions"):
        scatter(stream, [(addr, 0, 0, 4, 0, n + 1)])
    bad = stream.clone()
    bad[:4].view(torch.int32)[0] += 1  # the block counts no longer sum to k
    with pytest.raises(ValueError, match="sum to 5"):
        scatter(bad, [(addr, 0, 0, 4, 0, n)])
    with pytest.raises(ValueError, match="does not fit"):
        delta_host.scatter_idx16(stream[:20], n, 4, w, _values_at(ENC_IDX16, n, 4), [], [])
    with pytest.raises(ValueError, match="word must be"):
        _core.delta_scatter_idx16(3, n, 4, int(stream.data_ptr()), int(stream.data_ptr()) + _align(12),
                                  int(stream.data_ptr()) + 64, np.zeros((0, 7), np.int64), 1)


# -- in the sender and the receiver ----------------------------------------------------------------------
def test_sender_on_cpu_compares_with_the_host_kernels_as_the_torch_ops_do() -> None:
    """A CPU DeltaSender with keys of every word size: the host path (the reference updated in the
    compare: ref_done) and the torch path, from the same reference, find the same positions and values
    and leave the same reference; ``WEIGHTSYNC_DELTA_KERNELS=0`` keeps it on the torch ops."""
    import weightsync as ws
    from weightsync.delta.sender import DeltaSender

    g = torch.Generator().manual_seed(5)
    shapes = {"emb": ((3, 4099), torch.bfloat16), "norm": ((5,), torch.bfloat16),
              "proj": ((1001,), torch.float32), "fp8": ((777,), torch.uint8), "acc": ((65,), torch.int64)}
    tensors = {}
    for name, (shape, dtype) in shapes.items():
        t = torch.empty(shape, dtype=dtype)
        w = t.element_size()
        t.view(INTS[w]).reshape(-1).copy_(_random_words(t.numel(), w, g))
        tensors[name] = t
    engine = ws.TransferEngine()
    try:
        sender = DeltaSender(engine, tensors, torch.device("cpu"), 0, True)
        assert sender.use_kernels
        sender.start()
        sender.finish(1, True)
        for version in range(2, 5):
            for t in tensors.values():
                iv = t.view(INTS[t.element_size()]).reshape(-1)
                flip = torch.rand(iv.numel(), generator=g) < 0.05
                iv[flip] ^= 1
                iv[-1] ^= 2
            push_both_ways(sender, version, version, ref_done=True)
    finally:
        engine.close()


def test_the_environment_chooses_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightsync.delta.backend import kernels_wanted

    cpu = torch.device("cpu")
    monkeypatch.delenv("WEIGHTSYNC_DELTA_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert delta_host.wanted(cpu) and kernels_wanted(cpu)
    monkeypatch.setenv("WEIGHTSYNC_DELTA_KERNELS", "0")
    assert not delta_host.wanted(cpu) and not kernels_wanted(cpu)
    monkeypatch.setenv("WEIGHTSYNC_DELTA_KERNELS", "1")
    assert delta_host.wanted(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton kernels under their interpreter (tests)
    assert not delta_host.wanted(cpu)
    assert not delta_host.wanted(torch.device("meta"))
    monkeypatch.setenv("WEIGHTSYNC_DELTA_THREADS", "3")
    assert delta_host.threads() == 3
    monkeypatch.setenv("WEIGHTSYNC_DELTA_THREADS", "0")
    with pytest.raises(ValueError, match="at least 1"):
        delta_host.threads()
    monkeypatch.delenv("WEIGHTSYNC_DELTA_THREADS")
    # not torch's count (Ray sets it to 1)
    assert delta_host.threads() == min(len(os.sched_getaffinity(0)), delta_host.MAX_THREADS)
