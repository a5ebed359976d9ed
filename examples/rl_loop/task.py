"""The task and its verifiable reward: emit digits whose sum equals a target given in the prompt.

A prompt is ``[BOS, target]``; the policy answers with ``num_digits`` digits. The reward is 1 when the
digits add up to the target and 0 otherwise, so it can be checked exactly (no reward model). Targets are
drawn uniformly from every reachable sum ``0 .. 9 * num_digits``; with 3 digits that makes 28 targets,
and a policy that picks digits uniformly at random solves 1/28 = 3.6 % of prompts on average (the
extreme targets 0 and 27 have one answer in 1000, the middle ones 75). ``chance_reward`` computes it.

Solving it needs more than a lookup: the last digit must be the target minus the digits already
emitted, and the earlier digits must leave that remainder in 0..9 -- so reward rises steadily as the
policy learns arithmetic, which shows in a few minutes of CPU training.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

NUM_DIGIT_TOKENS = 10  # the action space: digits 0..9 (token ids 0..9)
BOS = NUM_DIGIT_TOKENS  # token id of the start of a prompt; targets follow it in the input vocabulary


@dataclass(frozen=True)
class DigitSumTask:
    num_digits: int = 3

    @property
    def max_target(self) -> int:
        return 9 * self.num_digits

    @property
    def vocab_size(self) -> int:
        """Input vocabulary: digits, BOS, then one token per target value."""
        return NUM_DIGIT_TOKENS + 1 + self.max_target + 1

    @property
    def prompt_len(self) -> int:
        return 2

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.num_digits

    def sample_targets(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(0, self.max_target + 1, (n,), generator=generator)

    def prompts(self, targets: torch.Tensor) -> torch.Tensor:
        """``[n, 2]`` token ids: BOS then the target's own token."""
        bos = torch.full_like(targets, BOS)
        return torch.stack([bos, targets + BOS + 1], dim=1)

    def reward(self, targets: torch.Tensor, digits: torch.Tensor) -> torch.Tensor:
        """1.0 where the emitted digits (``[n, num_digits]`` token ids) sum to the target, else 0.0."""
        return (digits.sum(dim=1) == targets).float()

    def chance_reward(self) -> float:
        """Expected reward of uniformly random digits for a uniformly random target (exact)."""
        counts = [0] * (self.max_target + 1)
        for digits in itertools.product(range(10), repeat=self.num_digits):
            counts[sum(digits)] += 1
        total = 10 ** self.num_digits
        return sum(c / total for c in counts) / len(counts)
