#!/usr/bin/env bash
# Old tree against new on one GPU host, alternating, in one call: scripts/ab_trees.sh OLD_DIR NEW_DIR.
# Make the trees here with `git archive <commit> | tar -x -C DIR` into an ignored, carried folder (e.g.
# .ab/old, .ab/new), carry it and .device, and run this from the repository root on the GPU host.
# Results (bench_cuda JSON, bench_push logs) go to $OUT (or ./ab_out).
set -o pipefail
old=${1:?old tree}; new=${2:?new tree}; out=${OUT:-$PWD/ab_out}; mkdir -p "$out"
.device/install.sh >/dev/null && source .device/env.sh || exit 1
export LIBFABRIC_ROOT=$PWD/.device/root/usr NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
for t in "$old" "$new"; do (cd "$t" && bash scripts/gpu_build.sh) || exit 1; done
n=0
for t in "$old" "$new" "$old" "$new"; do
  n=$((n + 1)); tag=$(basename "$t").$n
  echo "== bench_cuda $tag"
  (cd "$t" && PYTHONPATH=$PWD timeout 120 python3 scripts/bench_cuda.py --sizes-mib 256,1024,4096 \
    --cuda-piece-mib 0 --cuda-streams 1 --repeat 5 --latency-samples 100 --cuda-batch-mib 64 \
    --json "$out/cuda_$tag.json" 2>&1 | grep -E "ratio|4 KiB")
done
n=0
for t in "$old" "$new" "$old" "$new"; do
  n=$((n + 1)); tag=$(basename "$t").$n
  echo "== bench_push $tag"
  (cd "$t" && PYTHONPATH=$PWD timeout 240 python3 scripts/bench_push.py --device cuda --scenarios 5,6 \
    --baselines a --pushes 7 --reps 2 --budget-s 200 > "$out/push_$tag.log" 2>&1
   grep -E "^\| [56]\.|first push" "$out/push_$tag.log")
done
date -u
