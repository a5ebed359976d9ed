"""Which kernels a delta push runs on its device: on CPU the C++ host kernels (cpp/delta/,
:mod:`weightsync.delta.host`); on CUDA the CUDA C++ ones (:mod:`weightsync.delta.cuda`), else the Triton
ones (:mod:`weightsync.delta.triton_kernels`); with ``WEIGHTSYNC_DELTA_KERNELS=0`` torch ops everywhere."""

from __future__ import annotations

import os
from typing import Any


def kernels_wanted(device: Any) -> bool:
    """Whether the sender compares with device kernels (on CUDA: the CUDA C++ or the Triton ones, unless
    ``WEIGHTSYNC_DELTA_KERNELS=0``; :mod:`weightsync.delta.triton_kernels`); triton is not imported for a
    CPU sender unless the tests force the kernels under Triton's interpreter."""
    flag = os.environ.get("WEIGHTSYNC_DELTA_KERNELS", "")
    if flag == "0":
        return False
    if device.type != "cuda":
        from weightsync.delta import host as delta_host

        if delta_host.wanted(device):  # CPU: the C++ host kernels
            return True
        if flag != "1":
            return False
    from weightsync.delta import triton_kernels as delta_kernels

    return delta_kernels.enabled(device)
