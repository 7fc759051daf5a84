"""The critic: a scalar value per token from the policy's final hidden states (shared backbone).

Values come out of the same one-pass forward as the log-probs (``stream_logprobs(...,
value_head=head)``), so a stream rollout gets every value under exactly the eviction mask its
tokens were sampled with. The head starts at zero (values 0, advantages = returns).
"""

from __future__ import annotations

import torch
from torch import nn


class ValueHead(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden.to(self.proj.weight.dtype)).squeeze(-1)
