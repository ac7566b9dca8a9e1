"""learner.shared_prompts: a prompt group as one sequence gives the row layout's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.batch import TrainBatch, collate
from learner.model import forward_logprobs, takes_block_masks
from learner.shared_prompts import pack
from transport.messages import RolloutGroup, Sample


def group(rollout_id: str, prompts: list[list[int]], responses: list[list[int]]) -> RolloutGroup:
    samples = [Sample(prompt_ids=torch.tensor(p, dtype=torch.int32),
                      response_ids=torch.tensor(r, dtype=torch.int32),
                      logprobs=torch.zeros(len(r)), versions=torch.zeros(len(r), dtype=torch.int32),
                      reward=0.0)
               for p, r in zip(prompts, responses, strict=True)]
    return RolloutGroup(rollout_id=rollout_id, lease_id="L", prompt_id=rollout_id,
                        generator_id="g", samples=samples)


def small_batch() -> TrainBatch:
    return collate([group("a", [[5, 6]] * 2, [[7], [8, 9]]),
                    group("b", [[10, 11, 12]], [[13, 14]])], pad_id=0)


def test_a_group_packs_its_prompt_once_with_positions_restarting_after_it() -> None:
    packed = pack(small_batch())
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 2, 3], [0, 1, 2, 3, 4]]
    # group a: prompt 5 6, response one = 7, response two = 8 9
    assert packed.attend[0, 0].int().tolist() == [[1, 0, 0, 0, 0],
                                                  [1, 1, 0, 0, 0],
                                                  [1, 1, 1, 0, 0],
                                                  [1, 1, 0, 1, 0],
                                                  [1, 1, 0, 1, 1]]
    assert packed.attend[1, 0].int().tolist() == torch.ones(5, 5).tril().int().tolist()
    # row 1 (prompt 5 6, response 8 9) reads packed positions 0 1 3 4
    assert packed.source[1].tolist() == [0, 1, 3, 4, 0]
    assert packed.source[2].tolist() == [5, 6, 7, 8, 9]


def test_rows_of_a_group_with_different_prompts_get_sequences_of_their_own() -> None:
    packed = pack(collate([group("a", [[5, 6], [5, 7]], [[8], [9]])], pad_id=0))
    assert packed.input_ids.tolist() == [[5, 6, 8], [5, 7, 9]]


def test_padding_attends_only_to_itself() -> None:
    packed = pack(collate([group("a", [[5]], [[6]]), group("b", [[5, 6, 7]], [[8, 9]])],
                          pad_id=0))
    assert packed.attend[0, 0, 2:].int().tolist() == [[0, 0, 1, 0, 0], [0, 0, 0, 1, 0],
                                                      [0, 0, 0, 0, 1]]


def random_rollouts(seed: int) -> TrainBatch:
    """Groups of four samples with prompts and responses of different lengths; an empty
    response; a group whose rows do not share their prompt."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(length: int) -> list[int]:
        return torch.randint(3, 250, (length,), generator=generator).tolist()

    groups = []
    for index, prompt_length in enumerate((4, 9, 6)):
        prompt = tokens(prompt_length)
        responses = [tokens(length) for length in (3, 7, 1, 5)]
        groups.append(group(str(index), [prompt] * 4, responses))
    groups.append(group("odd", [tokens(5), tokens(3)], [tokens(2), tokens(4)]))
    groups.append(group("empty", [tokens(3)] * 2, [[], tokens(2)]))
    return collate(groups, pad_id=0)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_packed_log_probs_entropy_and_gradients_equal_the_rows(
        random_model_dir: Path, implementation: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32,
                                                 attn_implementation=implementation)
    batch = random_rollouts(0)
    mask = batch.response_mask
    results = []
    for share in (False, True):
        model.zero_grad()
        logprobs, entropy = forward_logprobs(model, batch, 0.7, True, share_prompts=share)
        ((logprobs + 0.1 * entropy) * mask).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results.append((logprobs * mask, entropy * mask, grads))
    (rows_lp, rows_h, rows_g), (packed_lp, packed_h, packed_g) = results
    torch.testing.assert_close(packed_lp, rows_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_h, rows_h, atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(rows_g, packed_g, strict=True):
        torch.testing.assert_close(theirs, mine, atol=1e-5, rtol=1e-4)


def test_only_attentions_that_take_a_custom_mask_share_prompts(random_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    assert takes_block_masks(model)  # sdpa
    model.config._attn_implementation = "flash_attention_2"  # varlen only: rows
    assert not takes_block_masks(model)
