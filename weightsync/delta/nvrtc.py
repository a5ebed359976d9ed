"""CUDA C++ kernels compiled at run time with NVRTC and launched through the driver API (ctypes), for the
few device kernels of a push that torch ops cannot do at memory speed (the delta compare's compaction).

No build-time CUDA: the kernels' source is compiled the first time a process needs them on a device of a
given architecture, with the NVRTC library PyTorch's CUDA build ships (or ``libnvrtc`` on the library
path), loaded into the device's primary context, and launched on torch's current stream of the tensors'
device. Arguments are typed explicitly (pointers and 64-bit integers; ctypes' default would pass ints
as 32 bits).

Everything here either works or raises :class:`NvrtcUnavailable` (no library, no device, compile
failure); callers fall back to their Triton or torch path then. :func:`compile_to_cubin` needs only the
NVRTC library, no GPU: the tests compile the kernels on CPU hosts with it to catch source errors.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any


class NvrtcUnavailable(RuntimeError):
    """The kernels cannot be compiled or loaded here (the caller takes its other path)."""


_lock = threading.Lock()
_nvrtc: ctypes.CDLL | None = None
_cuda: ctypes.CDLL | None = None
_modules: dict[tuple[str, int], Module] = {}  # (source key, device index) -> loaded module


def _candidates() -> list[str]:
    """Where libnvrtc may be: the nvidia wheels beside torch (cu13 and cu12 layouts), then the loader's
    search path."""
    out = []
    for base in sys.path:
        for pat in ("nvidia/cu1*/lib/libnvrtc.so.*", "nvidia/cuda_nvrtc/lib/libnvrtc.so.*"):
            out += sorted(p for p in glob.glob(os.path.join(base, pat)) if "builtins" not in p)
    return [*out, "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]


def nvrtc_library() -> ctypes.CDLL:
    global _nvrtc
    with _lock:
        if _nvrtc is None:
            errors = []
            for name in _candidates():
                try:
                    _nvrtc = ctypes.CDLL(name)
                    break
                except OSError as exc:
                    errors.append(str(exc))
            else:
                raise NvrtcUnavailable("no NVRTC library found (" + "; ".join(errors[-3:]) + ")")
        return _nvrtc


def _driver() -> ctypes.CDLL:
    global _cuda
    with _lock:
        if _cuda is None:
            try:
                _cuda = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise NvrtcUnavailable(f"no CUDA driver library: {exc}") from exc
        return _cuda


def _check_nvrtc(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        msg = lib.nvrtcGetErrorString(rc)
        raise NvrtcUnavailable(f"{what}: NVRTC error {rc} ({msg.decode() if msg else '?'})")


def _check_cuda(rc: int, what: str) -> None:
    if rc != 0:
        lib = _driver()
        s = ctypes.c_char_p()
        lib.cuGetErrorString(rc, ctypes.byref(s))
        raise NvrtcUnavailable(f"{what}: CUDA driver error {rc} ({s.value.decode() if s.value else '?'})")


HERE = os.path.dirname(os.path.abspath(__file__))  # the kernels' headers (block.h) lie beside this module


def compile_to_cubin(source: str, arch: str, names: Sequence[str], options: Sequence[str] = ()) -> bytes:
    """``source`` compiled for ``arch`` (e.g. ``sm_90``) into a cubin; ``names``: its ``extern "C"``
    kernels (checked to exist). Raises :class:`NvrtcUnavailable` with the compiler's log on failure."""
    lib = nvrtc_library()
    prog = ctypes.c_void_p()
    _check_nvrtc(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"weightsync.cu", 0, None,
                                             None), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device", f"--include-path={HERE}",
                *options]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        if rc != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise NvrtcUnavailable(f"compiling the kernels for {arch} failed:\n{log.value.decode()}")
        size = ctypes.c_size_t()
        _check_nvrtc(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib, lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    image = cubin.raw
    for n in names:
        if n.encode() not in image:
            raise NvrtcUnavailable(f"kernel {n} is not in the compiled module")
    return image


# argument kinds of :meth:`Kernel.launch`: a device pointer (an int address or a tensor), a signed 64-bit
# or a signed 32-bit integer
PTR, I64, I32 = "p", "q", "i"
_CTYPES = {PTR: ctypes.c_void_p, I64: ctypes.c_int64, I32: ctypes.c_int32}


class Kernel:
    """One kernel of a loaded module, with its argument kinds."""

    def __init__(self, func: ctypes.c_void_p, name: str, signature: str) -> None:
        self.func = func
        self.name = name
        self.signature = signature

    def launch(self, grid: int, block: int, args: Sequence[Any], stream: int, shared: int = 0) -> None:
        if len(args) != len(self.signature):
            raise TypeError(f"{self.name}: {len(args)} arguments, its signature has {len(self.signature)}")
        held = []
        for kind, a in zip(self.signature, args, strict=True):
            v = a.data_ptr() if hasattr(a, "data_ptr") else int(a)
            held.append(_CTYPES[kind](v))
        params = (ctypes.c_void_p * len(held))(*[ctypes.addressof(h) for h in held])
        _check_cuda(_driver().cuLaunchKernel(self.func, ctypes.c_uint(grid), 1, 1, ctypes.c_uint(block), 1, 1,
                                             ctypes.c_uint(shared), ctypes.c_void_p(stream), params, None),
                    f"launching {self.name}")


class Module:
    def __init__(self, kernels: dict[str, Kernel]) -> None:
        self.kernels = kernels

    def __getitem__(self, name: str) -> Kernel:
        return self.kernels[name]


def load(key: str, source: str, signatures: dict[str, str], device: Any,
         options: Sequence[str] = ()) -> Module:
    """The module of ``source`` (cached under ``key`` per device) on torch CUDA ``device``: compiled for
    its architecture and loaded into its primary context (made current on this thread by torch's device
    guard). ``signatures``: kernel name -> argument kinds (:data:`PTR`, :data:`I64`, :data:`I32`);
    ``options``: NVRTC's (``-D`` macros; the key must tell them apart)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    cached = _modules.get((key, index))
    if cached is not None:
        return cached
    major, minor = torch.cuda.get_device_capability(index)
    image = compile_to_cubin(source, f"sm_{major}{minor}", list(signatures), options)
    lib = _driver()
    with torch.cuda.device(index):
        torch.cuda.current_stream(index)  # the runtime has made the device's primary context current
        ctx = ctypes.c_void_p()
        _check_cuda(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            raise NvrtcUnavailable(f"no current CUDA context for device {index}")
        mod = ctypes.c_void_p()
        _check_cuda(lib.cuModuleLoadData(ctypes.byref(mod), image), "cuModuleLoadData")
        kernels = {}
        for name, sig in signatures.items():
            f = ctypes.c_void_p()
            _check_cuda(lib.cuModuleGetFunction(ctypes.byref(f), mod, name.encode()),
                        f"cuModuleGetFunction {name}")
            kernels[name] = Kernel(f, name, sig)
    m = Module(kernels)
    with _lock:
        _modules[(key, index)] = m
    return m
