"""Collating rollout groups into the shifted training grid."""

import pytest
import torch

from relay.learner.batch import collate
from relay.transport.messages import RolloutGroup, Sample


def sample(prompt: list[int], response: list[int], version: int = 0) -> Sample:
    return Sample(prompt_ids=torch.tensor(prompt, dtype=torch.int32),
                  response_ids=torch.tensor(response, dtype=torch.int32),
                  logprobs=-torch.arange(1, len(response) + 1, dtype=torch.float32) / 10,
                  versions=torch.full((len(response),), version, dtype=torch.int32),
                  reward=float(len(response)))


def test_collate_places_response_tokens_on_the_shifted_grid() -> None:
    groups = [RolloutGroup(rollout_id="a", lease_id="l", prompt_id="p", generator_id="g",
                           samples=[sample([5, 6, 7], [8, 9]), sample([5, 6, 7], [8])]),
              RolloutGroup(rollout_id="b", lease_id="l", prompt_id="q", generator_id="g",
                           samples=[sample([4], [3, 2, 1], version=2)])]
    batch = collate(groups, pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 8, 0], [4, 3, 2, 1, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]]
    # position j predicts token j + 1: responses start at prompt_length - 1
    assert batch.response_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0], [1, 1, 1, 0]]
    torch.testing.assert_close(batch.behavior_logprobs[2], torch.tensor([-0.1, -0.2, -0.3, 0.0]))
    assert batch.versions[2].tolist() == [2, 2, 2, -1]
    assert batch.versions[0].tolist()[:2] == [-1, -1]
    assert batch.group_ids.tolist() == [0, 0, 1]
    assert batch.rewards.tolist() == [2.0, 1.0, 3.0]
    assert batch.response_lengths.tolist() == [2, 1, 3]


def test_select_trims_unused_padding() -> None:
    groups = [RolloutGroup(rollout_id="a", lease_id="l", prompt_id="p", generator_id="g",
                           samples=[sample([1, 2, 3, 4], [5, 6]), sample([1], [2])])]
    part = collate(groups, pad_id=0).select(torch.tensor([1]))
    assert part.input_ids.tolist() == [[1, 2]]
    assert part.response_mask.tolist() == [[1]]


def test_group_weights_become_per_row_sample_weights() -> None:
    groups = [RolloutGroup(rollout_id="a", lease_id="l", prompt_id="p", generator_id="g",
                           samples=[sample([1], [2]), sample([1], [3])]),
              RolloutGroup(rollout_id="b", lease_id="l", prompt_id="q", generator_id="g",
                           samples=[sample([4], [5])])]
    assert collate(groups, pad_id=0).sample_weights.tolist() == [1.0, 1.0, 1.0]
    weighted = collate(groups, pad_id=0, group_weights=[0.25, 1.0])
    assert weighted.sample_weights.tolist() == [0.25, 0.25, 1.0]
    assert weighted.select(torch.tensor([1, 2])).sample_weights.tolist() == [0.25, 1.0]
    with pytest.raises(ValueError, match="1 group weights for 2 groups"):
        collate(groups, pad_id=0, group_weights=[0.5])


def test_a_loss_mask_keeps_inserted_tokens_in_the_row_but_off_the_response_mask() -> None:
    """A two-turn episode: policy tokens 8, 9, inserted 30, 31, policy token 10. The inserted
    tokens stay in the row (context of turn 2) and in ``response_lengths``; on the grid they
    are off the response: mask 0, behavior log-prob 0, version -1 (whatever the sample says
    there)."""
    episode = sample([5, 6], [8, 9, 30, 31, 10], version=1)
    episode.versions[4] = 2  # turn 2 after a weight swap
    episode.loss_mask = torch.tensor([True, True, False, False, True])
    groups = [RolloutGroup(rollout_id="a", lease_id="l", prompt_id="p", generator_id="g",
                           samples=[episode, sample([5, 6], [8])])]
    batch = collate(groups, pad_id=0)
    assert batch.input_ids[0].tolist() == [5, 6, 8, 9, 30, 31, 10]
    assert batch.attention_mask[0].tolist() == [1] * 7
    assert batch.response_lengths.tolist() == [5, 1]
    assert batch.response_mask.tolist() == [[0, 1, 1, 0, 0, 1], [0, 1, 0, 0, 0, 0]]
    torch.testing.assert_close(batch.behavior_logprobs[0],
                               torch.tensor([0.0, -0.1, -0.2, 0.0, 0.0, -0.5]))
    assert batch.versions[0].tolist() == [-1, 1, 1, -1, -1, 2]
    # an all-True mask is the single-turn sample
    everything = sample([5, 6], [8, 9, 30, 31, 10])
    plain = collate([RolloutGroup(rollout_id="b", lease_id="l", prompt_id="p",
                                  generator_id="g", samples=[everything])], pad_id=0)
    everything.loss_mask = torch.ones(5, dtype=torch.bool)
    masked = collate([RolloutGroup(rollout_id="b", lease_id="l", prompt_id="p",
                                   generator_id="g", samples=[everything])], pad_id=0)
    for name in masked.__struct_fields__:
        torch.testing.assert_close(getattr(masked, name), getattr(plain, name), rtol=0,
                                   atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("mask", [torch.ones(3, dtype=torch.bool), torch.ones(2)])
def test_a_loss_mask_of_the_wrong_shape_or_dtype_is_refused(mask: torch.Tensor) -> None:
    bad = sample([1], [2, 3])
    bad.loss_mask = mask
    groups = [RolloutGroup(rollout_id="a", lease_id="l", prompt_id="p", generator_id="g",
                           samples=[bad])]
    with pytest.raises(ValueError, match=r"loss_mask is .*it must be bool \(2,\)"):
        collate(groups, pad_id=0)
