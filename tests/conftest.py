import pytest
import torch

from compactrl.models.tiny import init_random, tiny_config
from compactrl.rl.reference import random_eviction_stream

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_lm():
    """A tiny random Qwen3-style model (no tokenizer needed) whose outputs depend on context."""
    return init_random(tiny_config("qwen3", vocab_size=300, eos_token_id=[1]), seed=0).eval()


random_stream = random_eviction_stream
