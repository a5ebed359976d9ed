"""Cluster-scale questions the planner answers without a cluster: layouts built from model configs
(``models``: Hugging Face checkpoints on the trainer side, vLLM's tensor-parallel and expert-parallel
layouts on the inference side) and a cost model that runs the planner's plan over NICs and NVLink
(``simulate``). Used by scripts/simulate.py, scripts/simulate_delta.py, scripts/emulated_cluster.py, the
benchmarks' model shapes and the tests; the coordinator never imports it. numpy only, like the planner
it drives: no Ray, no torch."""
