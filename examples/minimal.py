"""The smallest working push (README's first example): the driver is the one trainer rank, a Ray actor
the one rollout; one push of a 4x4 tensor of ones into the rollout's zeros. ``python -m examples.minimal``
prints 16.0."""

import ray
import torch

import weightsync as ws


@ray.remote
class Rollout:
    def __init__(self, secret: str) -> None:
        self.weights = {"w": torch.zeros(4, 4)}
        self.dst = ws.Destination("policy", rank=0, tensors=self.weights, mode="inplace", secret=secret)

    def total(self, version: int) -> float:
        self.dst.wait(version=version, timeout=60.0)          # version complete: safe to read
        return float(self.weights["w"].sum())


def main() -> None:
    ray.init(address="local", include_dashboard=False)
    group = ws.Group.create("policy", num_sources=1, num_destinations=1)   # its secret: group.secret
    rollout = Rollout.remote(group.secret)
    weights = {"w": torch.ones(4, 4)}                                       # the trainer's tensors
    src = ws.Source("policy", rank=0, tensors=weights, secret=group.secret)  # joins; the plan is made
    stats = ws.push(src, version=1, timeout=60.0)                            # after optimizer.step()
    print(stats.bytes, ray.get(rollout.total.remote(1)))                    # 64 16.0
    src.close()
    group.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
