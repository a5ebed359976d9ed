"""One rank of vLLM at tensor parallel TP on meta tensors (``python -m tests.vllm.real_shapes_rank RANK TP
PORT NAME tp|ep``): derives the layout of weightsync/sim/configs/NAME at real shapes from vLLM's loaders and
prints its boxes as a JSON line (tests/vllm/test_real_shapes.py compares them with sim.models)."""

from __future__ import annotations

import json
import sys


def main() -> None:
    import torch

    rank, tp, port = (int(x) for x in sys.argv[1:4])
    name, mode = sys.argv[4], sys.argv[5]
    if not torch.cpu._is_amx_tile_supported():
        # as tests/vllm/test_fp8_layouts.py's fixture: the FP8 GEMM kernel is chosen when layers are
        # made, used only in forward
        from vllm.model_executor.kernels.linear.scaled_mm import cpu as cpu_kernels

        cpu_kernels.CPUFp8BlockScaledMMKernel.is_supported = classmethod(
            lambda cls, compute_capability=None: (True, None))
    from tests.vllm.test_real_shapes import derived_boxes, real_config

    boxes, unused = derived_boxes(real_config(name), tp=tp, rank=rank, port=port, ep=mode == "ep")
    print(json.dumps({"boxes": sorted(boxes), "unused": len(unused)}))


if __name__ == "__main__":
    main()
