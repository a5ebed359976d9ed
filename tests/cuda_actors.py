"""Ray GPU actors for the cuda-lane tests and benchmark: each sees only its own GPU, as ``cuda:0``."""

from __future__ import annotations

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
    def __init__(self) -> None:
        self.engine = ws.TransferEngine(transport="cuda")
        self.buffers: dict[int, torch.Tensor] = {}
        self.regions: dict[int, Any] = {}
        self.peers: dict[bytes, Any] = {}

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

    def free(self, region: int) -> None:
        self.engine.deregister(self.regions.pop(region))
        del self.buffers[region]
        torch.cuda.empty_cache()

    def _peer(self, address: bytes) -> Any:
        if address not in self.peers:
            self.peers[address] = self.engine.connect(address)
        return self.peers[address]

    def transport_to(self, address: bytes) -> str:
        return self._peer(address).transport

    def write(self, region: int, src_off: int, address: bytes, descriptor: bytes, dst_off: int, nbytes: int,
              imm: int | None = 1, repeat: int = 1, timeout: float = 60.0) -> dict[str, Any]:
        torch.cuda.synchronize()
        peer = self._peer(address)
        times = []
        imm_count = 0
        for _ in range(repeat):
            t0 = time.perf_counter()
            t = self.engine.write(self.regions[region], src_off, peer, descriptor, dst_off, nbytes, imm)
            t.wait(timeout)
            times.append(time.perf_counter() - t0)
            imm_count += t.imm_count
        return {"times": times, "imm_count": imm_count}

    def counter_wait(self, imm: int, n: int, timeout: float = 60.0) -> None:
        self.engine.counter(imm).wait(n, timeout)

    def check(self, region: int, off: int, nbytes: int, seed: int, src_off: int) -> dict[str, bool]:
        """The bytes at [off, off+nbytes) equal the source pattern's [src_off, ...); the rest is poison."""
        buf = self.buffers[region]
        want = pattern(src_off + nbytes, seed)[src_off:]
        return {
            "data": bool(torch.equal(buf[off:off + nbytes], want)),
            "before": bool((buf[:off] == POISON).all()),
            "after": bool((buf[off + nbytes:] == POISON).all()),
        }

    def stats(self) -> list[dict[str, Any]]:
        return self.engine.stats()
