"""Baseline c of scripts/bench_push.py: ``checkpoint-engine`` (PyPI) in broadcast mode.

How its users run it: one ``ParameterServer`` process per GPU beside the inference engine's worker on
that GPU (torchrun next to vLLM). The checkpoint is registered into pinned host memory on the ranks that
own it; ``update()`` copies each bucket host-to-device on its owner, NCCL-broadcasts it to every rank, and
hands it to the worker on the same GPU through a CUDA IPC handle and ZMQ (vLLM's worker extension runs
``checkpoint_engine.worker.update_weights_from_ipc``, whose ``run`` is the model's ``load_weights``).

Here every benchmark ``Worker`` actor (trainers and rollouts, world = all T + R GPUs) starts one
``ParameterServer`` child process on its GPU. The trainers' children register the trainers' own dim-0
shards (shared with the child through CUDA IPC), named ``<tensor>#<trainer rank>``: no all-gather first,
which favours checkpoint-engine. The Worker itself plays vLLM's worker: it runs
``update_weights_from_ipc`` with a ``load_weights`` that copies each shard's rows into the rollout's fused
parameters (trainers' workers receive too, as every rank does in broadcast mode, and drop the bytes).
One process group for the whole run (``auto_pg=False``), so communicator set-up is never timed.

Timed: ``ParameterServer.update`` (max over ranks). Reported beside it: ``register``, the trainers'
snapshot of their shards into the pinned pool (device to host), which an RL step also pays.

On CPU (``--device cpu``, for checking the flow without GPUs) a shim stands in for what checkpoint-engine
takes from CUDA: gloo instead of NCCL, plain instead of pinned host memory, and files in /dev/shm instead
of CUDA IPC handles. On GPUs nothing is patched.
"""

from __future__ import annotations

import glob
import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, ClassVar

import torch

NAME = "bench"
_SHM_PREFIX = "/dev/shm/bench-ce-"


# ------------------------------------------------------------------------------------------------
# The ParameterServer process (one per GPU)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def ps_main(conn: Any, rank: int, world: int, port: int, device: str, flat: torch.Tensor | None,
            views: list[tuple[str, int, tuple[int, ...]]], env: dict[str, str]) -> None:
    os.environ.update(env)
    _exit_with_parent()
    shards = {} if flat is None else {k: flat[o:o + _numel(sh)].view(sh) for k, o, sh in views}
    try:
        if device == "cpu":
            cpu_shim(f"cpu-{os.getpid()}")
        else:
            torch.cuda.set_device(0)
        from checkpoint_engine.ps import ParameterServer

        ps = ParameterServer(rank=rank, world_size=world, auto_pg=False, master_addr="127.0.0.1",
                             master_port=port)
        ps.init_process_group()
        conn.send(("ready", ps._device_uuid))
        registered = False
        while True:
            cmd = conn.recv()
            if cmd == "register":
                t0 = time.perf_counter()
                if shards:
                    if registered:  # keeps the pinned pool, frees the name for this version's values
                        ps.unregister_checkpoint(NAME)
                    ps.register_checkpoint(NAME, named_tensors=shards, use_shared_memory_pool=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
                ps.gather_metas(NAME)
                registered = True
                conn.send(("registered", seconds))
            elif cmd == "update":
                def req(socket_paths: list[tuple[str, str]]) -> None:
                    # "request the inference engine to update": tell this GPU's worker where to connect
                    conn.send(("req", dict(socket_paths)[ps._device_uuid]))

                t0 = time.perf_counter()
                ps.update(NAME, req)
                conn.send(("done", time.perf_counter() - t0))
            elif cmd == "stop":
                conn.send(("stopped", 0))
                break
    except Exception:
        conn.send(("error", traceback.format_exc()))
    # No teardown of the process group or the pinned pool: an NCCL teardown can wait on peers that are
    # gone, and the process's end frees everything anyway.
    os._exit(0)


def _exit_with_parent() -> None:
    """A killed Worker actor (Ray kills with SIGKILL) must not leave its ParameterServer holding GPU memory
    for the next scenario: exit as soon as the parent is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


# ------------------------------------------------------------------------------------------------
# The Worker's side: start the PS child, play the inference worker


class CkptEngineRank:
    def __init__(self, rank: int, world: int, port: int, device: str, flat: torch.Tensor | None,
                 views: list[tuple[str, int, tuple[int, ...]]],
                 load: Callable[[list[tuple[str, torch.Tensor]]], None], timeout: float) -> None:
        self.device, self.load, self.timeout = device, load, timeout
        if device == "cpu":
            cpu_shim(f"cpu-worker-{os.getpid()}")
        ctx = torch.multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
        if device == "cpu":
            # 2 MiB buckets: the model is tiny, and a bucket size must keep 256-byte alignment (a size
            # of 0.002 GiB is odd, and the second half of the double buffer then starts misaligned)
            env["PS_MAX_BUCKET_SIZE_GB"] = os.environ.get("PS_MAX_BUCKET_SIZE_GB", str(2 / 1024))
        self.proc = ctx.Process(target=ps_main, args=(child, rank, world, port, device, flat, views, env),
                                daemon=True)
        self.proc.start()
        self._expect("ready")
        import zmq

        self.zmq_ctx = zmq.Context()

    def _expect(self, kind: str) -> Any:
        if not self.conn.poll(self.timeout):
            raise TimeoutError(f"checkpoint-engine ParameterServer: no {kind!r} within {self.timeout} s")
        got, value = self.conn.recv()
        if got == "error":
            raise RuntimeError(f"checkpoint-engine ParameterServer failed:\n{value}")
        if got != kind:
            raise RuntimeError(f"checkpoint-engine ParameterServer: expected {kind!r}, got {got!r}")
        return value

    def register(self) -> float:
        self.conn.send("register")
        return float(self._expect("registered"))

    def update(self) -> float:
        from checkpoint_engine.worker import update_weights_from_ipc

        self.conn.send("update")
        handle = self._expect("req")
        errors: list[BaseException] = []

        def serve() -> None:
            try:
                update_weights_from_ipc(self.zmq_ctx, handle, device_id=0, run=self.load, post_hook=None)
            except BaseException as exc:  # reported by update() on the actor's thread
                errors.append(exc)

        th = threading.Thread(target=serve, name="ckpt-engine-worker", daemon=True)
        th.start()
        seconds = float(self._expect("done"))
        th.join(self.timeout)
        if errors:
            raise errors[0]
        return seconds

    def stop(self) -> None:
        try:
            self.conn.send("stop")
            self.conn.poll(10)
        except (OSError, EOFError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        for path in glob.glob(f"{_SHM_PREFIX}{self.proc.pid}-*"):
            os.unlink(path)


# ------------------------------------------------------------------------------------------------
# CPU stand-ins for what checkpoint-engine takes from CUDA (never used on GPUs)


class _Props:
    def __init__(self, uuid: str) -> None:
        self.uuid = uuid


class _CpuDevice:
    """Stands in for ``torch.cuda`` as checkpoint-engine's DeviceManager uses it."""

    def __init__(self, uuid: str) -> None:
        self._props = _Props(uuid)

    def synchronize(self, *args: Any) -> None:
        pass

    def ipc_collect(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def mem_get_info(self, *args: Any) -> tuple[int, int]:
        return 1 << 30, 2 << 30

    def memory_allocated(self, *args: Any) -> int:
        return 0

    def memory_reserved(self, *args: Any) -> int:
        return 0

    def set_device(self, *args: Any) -> None:
        pass

    def device_count(self) -> int:
        return 1

    def get_device_properties(self, *args: Any) -> _Props:
        return self._props


class _TorchProxy:
    """``torch`` with ``empty`` changed: no pinned memory (needs an accelerator), and 1-D byte buffers
    on CPU backed by files in /dev/shm, so that another process can map them like a CUDA IPC handle."""

    _count = 0
    shm: ClassVar[dict[int, tuple[str, int]]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def empty(self, *size: Any, **kw: Any) -> torch.Tensor:
        kw.pop("pin_memory", None)
        if kw.get("dtype") == torch.uint8 and str(kw.get("device", "cpu")) == "cpu" and len(size) == 1 \
                and isinstance(size[0], int) and size[0] > 0:
            _TorchProxy._count += 1
            path = f"{_SHM_PREFIX}{os.getpid()}-{_TorchProxy._count}"
            t = torch.from_file(path, shared=True, size=size[0], dtype=torch.uint8)
            _TorchProxy.shm[t.data_ptr()] = (path, size[0])
            return t
        return torch.empty(*size, **kw)


def open_shm(path: str, size: int, *_: Any) -> torch.Tensor:
    """Rebuilds a /dev/shm buffer in the worker (the CPU stand-in for opening a CUDA IPC handle)."""
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def _reduce_shm(t: torch.Tensor) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
    path, size = _TorchProxy.shm[t.data_ptr()]
    # seven arguments: checkpoint-engine's worker overwrites argument 6 (a CUDA handle's device)
    return open_shm, (path, size, 0, 0, 0, 0, 0)


def cpu_shim(uuid: str) -> None:
    import checkpoint_engine.device_utils as du
    import checkpoint_engine.pin_memory as pm
    import checkpoint_engine.ps as ps
    import checkpoint_engine.worker as wk

    dev = _CpuDevice(uuid)

    def init(self: Any) -> None:
        self.device_type = "cpu"
        self.device_module = dev

    du.DeviceManager.__init__ = init  # type: ignore[method-assign]
    du.DeviceManager.backend = property(lambda self: "gloo")  # type: ignore[method-assign,assignment]
    ps.DeviceManager = du.DeviceManager
    wk.DeviceManager = du.DeviceManager
    pm.torch = _TorchProxy()  # type: ignore[assignment]
    ps.torch = _TorchProxy()  # type: ignore[assignment]
    ps.reduce_tensor = _reduce_shm
