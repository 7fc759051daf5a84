import numpy as np
import pytest
import torch

from compactrl.models.tiny import init_random, tiny_config
from compactrl.trace import Trace

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_lm():
    """A tiny random Qwen3-style model (no tokenizer needed) whose outputs depend on context."""
    return init_random(tiny_config("qwen3", vocab_size=300, eos_token_id=[1]), seed=0).eval()


def random_stream(seed: int, T: int = 160, vocab: int = 300, n_events: int = 3) -> Trace:
    """A stream with several evictions, including spans in the middle and right before the end."""
    rng = np.random.default_rng(seed)
    evict_at = np.full(T, T)
    for e in sorted(rng.choice(np.arange(8, T), size=n_events, replace=False)):
        live = np.flatnonzero(evict_at[:e] == T)
        live = live[live > 0]  # the first token (the "system prompt") is protected
        if len(live) < 2:
            continue
        a = rng.integers(0, len(live) - 1)
        b = rng.integers(a + 1, min(a + 40, len(live)) + 1)
        evict_at[live[a:b]] = e
    trainable = rng.random(T) < 0.5
    trainable[0] = False
    return Trace.from_tokens(
        rng.integers(0, vocab, T), evict_at=evict_at, trainable=trainable, rollout_id=f"r{seed}"
    )
