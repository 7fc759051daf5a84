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


def recall_gap_lengths(fmt, variant: str, padded: bool = True) -> set[int]:
    """Token lengths of the recall task's evictable assignment message over every candidate and
    start (and none assigned), as the runner renders it after the task message: one length means
    the gap an eviction leaves in the positions says nothing about the answer."""
    from compactrl.envs.recall import RecallEnv

    reset = RecallEnv(variant=variant).reset(seed=0)
    chat = fmt.conversation()
    chat.message("user", reset.task)
    texts = reset.observation_variants
    if padded:
        texts = [chat.padded("user", t, texts) for t in texts]
    return {len(chat.message("user", t, record=False)) for t in texts}
