"""Ray GPU actors for the cuda-lane tests and benchmark: each sees only its own GPU, as ``cuda:0``."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

import weightsync as ws

POISON = 0xA5


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """Random bytes on this GPU, reproducible from the seed in any process."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)


class GpuEnd:
    def __init__(self, **engine_kwargs: Any) -> None:
        self.engine = ws.TransferEngine(transport="cuda", **engine_kwargs)
        self.buffers: dict[int, torch.Tensor] = {}
        self.regions: dict[int, Any] = {}
        self.peers: dict[bytes, Any] = {}
        self.forwards: list[Any] = []

    def info(self) -> dict[str, Any]:
        props = torch.cuda.get_device_properties(0)
        return {"address": self.engine.address, "gpu": props.name, "uuid": str(getattr(props, "uuid", ""))}

    def alloc(self, nbytes: int, seed: int | None = None) -> list[Any]:
        buf = (torch.full((nbytes,), POISON, dtype=torch.uint8, device="cuda") if seed is None
               else pattern(nbytes, seed))
        region = self.engine.register(buf)
        self.buffers[region.id] = buf
        self.regions[region.id] = region
        return [region.id, region.descriptor]

    def alloc_host(self, nbytes: int) -> list[Any]:
        """Poisoned host memory: a destination only the fabric NICs can write (no CUDA IPC handle)."""
        buf = torch.full((nbytes,), POISON, dtype=torch.uint8)
        region = self.engine.register(buf)
        self.buffers[region.id] = buf
        self.regions[region.id] = region
        return [region.id, region.descriptor]

    def free(self, region: int) -> None:
        self.engine.deregister(self.regions.pop(region))
        del self.buffers[region]
        torch.cuda.empty_cache()

    def reconfigure(self, **engine_kwargs: Any) -> None:
        """A fresh engine with other settings (cuda_piece, cuda_streams, ...); regions and peers go."""
        self.engine.close()
        self.regions.clear()
        self.buffers.clear()
        self.peers.clear()
        self.forwards.clear()
        torch.cuda.empty_cache()
        self.engine = ws.TransferEngine(transport="cuda", **engine_kwargs)

    def setenv(self, key: str, value: str | None) -> None:
        """Sets (or with None removes) an environment variable of this actor's process, for the next
        engine ``reconfigure`` makes (e.g. WEIGHTSYNC_FABRIC_HMEM=0: no GPU memory on the NICs)."""
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value

    def landing(self, region: int) -> int:
        """The region's landing index (-1: not a landing region)."""
        return self.regions[region].landing

    def deregister(self, region: int) -> None:
        """Deregisters a region but keeps (and re-poisons) its memory, so a stray write would show."""
        self.engine.deregister(self.regions.pop(region))
        self.buffers[region].fill_(POISON)
        torch.cuda.synchronize()

    def untouched(self, region: int) -> bool:
        return bool((self.buffers[region] == POISON).all())

    def _peer(self, address: bytes) -> Any:
        if address not in self.peers:
            self.peers[address] = self.engine.connect(address)
        return self.peers[address]

    def transport_to(self, address: bytes) -> str:
        return self._peer(address).lane

    def write(self, region: int, src_off: int, address: bytes, descriptor: bytes, dst_off: int, nbytes: int,
              imm: int | None = 1, repeat: int = 1, timeout: float = 60.0, rows: int = 1, src_pitch: int = 0,
              dst_pitch: int = 0) -> dict[str, Any]:
        torch.cuda.synchronize()
        peer = self._peer(address)
        times = []
        imm_count = 0
        for _ in range(repeat):
            t0 = time.perf_counter()
            t = self.engine.write(self.regions[region], src_off, peer, descriptor, dst_off, nbytes, imm,
                                  rows=rows, src_pitch=src_pitch, dst_pitch=dst_pitch)
            t.wait(timeout)
            times.append(time.perf_counter() - t0)
            imm_count += t.imm_count
        return {"times": times, "imm_count": imm_count}

    def write_batch(self, region: int, address: bytes, descriptor: bytes, ops: list[tuple[int, ...]],
                    imm: int, timeout: float = 60.0) -> dict[str, Any]:
        """One write_batch of ``ops`` = (src_off, dst_off, row bytes, rows, src_pitch, dst_pitch) into one
        destination region: the immediates it delivers, and seconds from submit to completion."""
        import numpy as np

        torch.cuda.synchronize()
        cols = np.array(ops, dtype=np.int64).reshape(-1, 6).T
        zeros = np.zeros(len(ops), dtype=np.uint32)
        dst = [(self._peer(address), descriptor)]
        t0 = time.perf_counter()
        t = self.engine.write_batch([self.regions[region]], dst, zeros, cols[0], zeros, cols[1], cols[2], imm,
                                    cols[3], cols[4], cols[5])
        t.wait(timeout)
        return {"imm_count": t.imm_count, "seconds": time.perf_counter() - t0}

    def forward(self, on_imm: int, count: int, region: int, src_off: int, address: bytes, descriptor: bytes,
                dst_off: int, nbytes: int, imm: int | None = None, **geometry: int) -> int:
        """Registers a triggered write; returns the immediates it will deliver (``forward_wait`` waits)."""
        fwd = self.engine.forward(on_imm, count, self.regions[region], src_off, self._peer(address),
                                  descriptor, dst_off, nbytes, imm, **geometry)
        self.forwards.append(fwd)
        return fwd.transfer.imm_count

    def forward_wait(self, timeout: float = 60.0) -> int:
        """Waits for every triggered write registered so far; returns how many there were."""
        for fwd in self.forwards:
            fwd.transfer.wait(timeout)
        n = len(self.forwards)
        self.forwards = []
        return n

    def imm_count(self, nbytes: int, rows: int = 1) -> int:
        return self.engine.imm_count(nbytes, rows=rows)

    def counter_wait(self, imm: int, n: int, timeout: float = 60.0) -> None:
        self.engine.counter(imm).wait(n, timeout)

    def check(self, region: int, off: int, nbytes: int, seed: int, src_off: int) -> dict[str, bool]:
        """The bytes at [off, off+nbytes) equal the source pattern's [src_off, ...); the rest is poison."""
        buf = self.buffers[region]
        want = pattern(src_off + nbytes, seed)[src_off:].to(buf.device)
        return {
            "data": bool(torch.equal(buf[off:off + nbytes], want)),
            "before": bool((buf[:off] == POISON).all()),
            "after": bool((buf[off + nbytes:] == POISON).all()),
        }

    def check_rows(self, region: int, off: int, rows: int, row_bytes: int, pitch: int, seed: int,
                   src_off: int, src_pitch: int, src_len: int) -> dict[str, bool]:
        """Rows of a 2-D write: each equals its row of the source pattern (``src_len`` bytes from
        ``seed``); every byte outside the rows, between them included, is still poison."""
        buf = self.buffers[region]
        want = pattern(src_len, seed)
        r = torch.arange(rows, device="cuda").unsqueeze(1)
        c = torch.arange(row_bytes, device="cuda").unsqueeze(0)
        got_idx = (off + r * pitch + c).flatten()
        want_idx = (src_off + r * src_pitch + c).flatten()
        mask = torch.ones(buf.numel(), dtype=torch.bool, device="cuda")
        mask[got_idx] = False
        return {
            "data": bool(torch.equal(buf[got_idx], want[want_idx])),
            "outside": bool((buf[mask] == POISON).all()),
        }

    def check_ops(self, region: int, ops: list[tuple[int, ...]], seed: int, src_len: int) -> dict[str, bool]:
        """Each (src_off, dst_off, row, rows, src_pitch, dst_pitch) landed: its rows equal the source's."""
        buf = self.buffers[region]
        want = pattern(src_len, seed)
        for so, do, row, rows, sp, dp in ops:
            for r in range(rows):
                if not torch.equal(buf[do + r * dp:do + r * dp + row], want[so + r * sp:so + r * sp + row]):
                    return {"data": False, "op": [so, do, row, rows, sp, dp], "row": r}
        return {"data": True}

    def check_spans(self, region: int, spans: list[tuple[int, int, int]], seed: int,
                    src_len: int) -> dict[str, Any]:
        """Several writes into one region, (src_off, dst_off, nbytes) each, from a source pattern of
        ``src_len`` bytes from ``seed``: each span holds its bytes; every byte outside them is poison.
        On a mismatch, where (first bad offsets, for diagnostics)."""
        buf = self.buffers[region]
        want = pattern(src_len, seed)
        mask = torch.ones(buf.numel(), dtype=torch.bool, device=buf.device)
        out: dict[str, Any] = {"data": True, "outside": True}
        for so, do, n in spans:
            got = buf[do:do + n]
            if not torch.equal(got, want[so:so + n]):
                bad = (got != want[so:so + n]).nonzero().flatten()[:8].tolist()
                out["data"] = False
                out.setdefault("bad", []).append({"span": [so, do, n], "first_bad": bad})
            mask[do:do + n] = False
        outside = (buf != POISON) & mask
        if bool(outside.any()):
            out["outside"] = False
            out["outside_first"] = outside.nonzero().flatten()[:8].tolist()
        return out

    def export_info(self, region: int) -> dict[str, Any]:
        """How the cuda lane exported a region (``vmm``: through CUDA virtual-memory file descriptors, as
        expandable segments need; else a CUDA IPC handle), and what PyTorch says of the memory under it."""
        buf = self.buffers[region]
        blob = self.regions[region].cuda_blob
        ptr = buf.data_ptr()
        segment = None
        for seg in torch.cuda.memory_snapshot():
            if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
                segment = {k: seg.get(k) for k in ("address", "total_size", "segment_type", "is_expandable")}
        return {
            "vmm": blob[:8] == b"WSVMMv1\0",
            "chunks": int.from_bytes(blob[32:40], "little") if blob[:8] == b"WSVMMv1\0" else 0,
            "blob_bytes": len(blob),
            "ptr": ptr,
            "nbytes": buf.numel(),
            "segment": segment,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "torch": torch.__version__,
            "pid": os.getpid(),
        }

    def stats(self) -> list[dict[str, Any]]:
        return self.engine.stats()
