"""`--set` values: TOML literals, read for the field they set."""

import math

import pytest

from compactrl.config import ConfigError, load_config
from compactrl.rl.loop import TrainConfig


def test_set_inf_and_nan_are_text_for_a_string_field_and_numbers_for_a_float_field():
    """TOML reads a bare ``inf``/``nan`` as a float; a string field set to one keeps the text, a
    float field gets the number, an int field names the problem."""
    for text in ("inf", "+inf", "-inf", "nan", "1e999"):
        assert load_config(TrainConfig, None, [f"out={text}"]).out == text
    rft = "objective.name=rft"
    cfg = load_config(TrainConfig, None, [rft, "objective.min_reward=-inf", "train.grad_clip=inf"])
    assert cfg.objective.min_reward == -math.inf and cfg.train.grad_clip == math.inf
    assert math.isnan(load_config(TrainConfig, None, [rft, "objective.min_reward=nan"]).objective.min_reward)
    assert load_config(TrainConfig, None, ["train.lr=1e-3", "out=runs/x"]).train.lr == 1e-3  # as before
    with pytest.raises(ConfigError, match="steps: Input should be a valid integer.*from --set steps=inf"):
        load_config(TrainConfig, None, ["steps=inf"])
