"""The critic's value model: a trained critic in verl's layout keeps its head when it is
read back (``relay export --critic`` and ``relay import-verl`` write that layout)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForTokenClassification

from relay.learner.critic import load_value_model
from relay.learner.hf_export import value_model_as_token_classification, write_state

from ..conftest import gather_full_weights

pytestmark = pytest.mark.usefixtures("one_rank_group")
IDS = torch.tensor([[1, 271, 201, 273, 272, 223, 19, 20], [1, 24, 25, 26, 27, 2, 201, 278]])
CPU = torch.device("cpu")


def test_a_trained_critic_is_read_back_with_its_value_head(random_model_dir: Path,
                                                           tmp_path: Path) -> None:
    critic = load_value_model(str(random_model_dir), compute_dtype=torch.float32, device=CPU)
    with torch.no_grad():  # a trained head: the zero head a fresh critic starts from is not
        critic.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
        critic.value_head.bias.fill_(0.25)
        values = critic(IDS)
    assert values.abs().max() > 0.1
    body = AutoModelForTokenClassification.from_config(
        AutoConfig.from_pretrained(random_model_dir, num_labels=1))
    state = value_model_as_token_classification(
        gather_full_weights(critic, torch.float32), body.base_model_prefix)
    exported = tmp_path / "critic"
    write_state(state, body.config, AutoModelForTokenClassification, exported, torch.float32)

    again = load_value_model(str(exported), compute_dtype=torch.float32, device=CPU)
    with torch.no_grad():
        torch.testing.assert_close(again(IDS), values, atol=1e-5, rtol=1e-5)
    fresh = load_value_model(str(random_model_dir), compute_dtype=torch.float32, device=CPU)
    with torch.no_grad():
        assert torch.equal(fresh(IDS), torch.zeros_like(values))  # a causal LM: a zero head
