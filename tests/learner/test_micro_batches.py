"""relay.learner.micro_batches: passes hold rows of like length, by row count or by token budget
(per GPU: an SP group's passes hold its size times as many tokens), and every row of a
mini-batch is in exactly one pass."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from relay.learner.batch import TrainBatch
from relay.learner.micro_batches import MicroBatches
from relay.learner.ulysses import SequenceParallel

LENGTHS = [9, 3, 7, 3, 12, 5, 8, 4, 6, 10]


def batch() -> TrainBatch:
    rows, width = len(LENGTHS), max(LENGTHS)
    attention = torch.zeros((rows, width), dtype=torch.long)
    for row, length in enumerate(LENGTHS):
        attention[row, :length] = 1
    return TrainBatch(input_ids=attention.clone(), attention_mask=attention,
                      response_mask=attention[:, 1:].float(),
                      behavior_logprobs=torch.zeros(rows, width - 1),
                      versions=torch.zeros(rows, width - 1, dtype=torch.long),
                      rewards=torch.zeros(rows), group_ids=torch.arange(rows) // 2,
                      response_lengths=torch.ones(rows, dtype=torch.long),
                      sample_weights=torch.ones(rows), baseline_rewards=torch.zeros(rows))


def test_row_count_cut_sorts_by_length_and_trims_each_pass() -> None:
    micro = MicroBatches(groups_per_mini_batch=5, micro_batch_size=4)
    whole = batch()
    (mini,) = micro.mini_batches(whole)
    passes = list(micro.passes(whole, mini))
    assert [len(p.rows) for p in passes] == [4, 3, 3]
    assert sorted(torch.cat([p.rows for p in passes]).tolist()) == list(range(10))
    assert [p.part.input_ids.shape[1] for p in passes] == [5, 8, 12]  # each its own longest
    assert all(p.weight == 1.0 for p in passes)


def test_token_budget_cut_keeps_each_pass_within_budget() -> None:
    micro = MicroBatches(groups_per_mini_batch=5, micro_batch_size=1, max_token_len=24)
    whole = batch()
    (mini,) = micro.mini_batches(whole)
    passes = list(micro.passes(whole, mini))
    assert sorted(torch.cat([p.rows for p in passes]).tolist()) == list(range(10))
    for p in passes:
        assert len(p.rows) * p.part.input_ids.shape[1] <= 24
    # sorted lengths 3 3 4 5 | 6 7 8 | 9 10 | 12 (five 5-token rows would be 25 > 24)
    assert [len(p.rows) for p in passes] == [4, 3, 2, 1]


@pytest.mark.usefixtures("one_rank_group")
def test_under_sequence_parallelism_the_token_budget_is_per_gpu() -> None:
    """verl's ``ppo_max_token_len_per_gpu * ulysses_sequence_parallel_size``: each of the
    two ranks of an SP group runs half of a pass's tokens, so a 12-token budget per GPU
    cuts the passes a 24-token budget cuts without SP."""
    sp = SequenceParallel(dist.group.WORLD, size=2, rank=0)
    micro = MicroBatches(groups_per_mini_batch=5, micro_batch_size=1, max_token_len=12, sp=sp)
    whole = batch()
    (mini,) = micro.mini_batches(whole)
    passes = list(micro.passes(whole, mini))
    assert micro.max_token_len == 24
    assert [len(p.rows) for p in passes] == [4, 3, 2, 1]  # as with 24 tokens without SP
    for p in passes:  # each GPU's share of a pass stays within its own budget
        assert len(p.rows) * p.part.input_ids.shape[1] / sp.size <= 12


def test_a_row_longer_than_the_budget_gets_a_pass_of_its_own() -> None:
    micro = MicroBatches(groups_per_mini_batch=5, micro_batch_size=1, max_token_len=10)
    whole = batch()
    (mini,) = micro.mini_batches(whole)
    passes = list(micro.passes(whole, mini))
    assert [p.part.input_ids.shape[1] for p in passes][-1] == 12
    assert len(passes[-1].rows) == 1


def grouped_batch(prompt_lengths: list[int], response_lengths: list[list[int]]) -> TrainBatch:
    """One group per prompt length, with those responses."""
    rows = [(g, p, r) for g, (p, rs) in enumerate(zip(prompt_lengths, response_lengths))
            for r in rs]
    width = max(p + r for _, p, r in rows)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (_, p, r) in enumerate(rows):
        attention[row, :p + r] = 1
    count = len(rows)
    return TrainBatch(input_ids=attention.clone(), attention_mask=attention,
                      response_mask=attention[:, 1:].float(),
                      behavior_logprobs=torch.zeros(count, width - 1),
                      versions=torch.zeros(count, width - 1, dtype=torch.long),
                      rewards=torch.zeros(count),
                      group_ids=torch.tensor([g for g, _, _ in rows]),
                      response_lengths=torch.tensor([r for _, _, r in rows]),
                      sample_weights=torch.ones(count), baseline_rewards=torch.zeros(count))


def test_sharing_prompts_keeps_groups_whole_ordered_by_packed_length() -> None:
    # packed lengths: group 0: 5 + 8 = 13, group 1: 2 + 4 = 6, group 2: 3 + 12 = 15
    whole = grouped_batch([5, 2, 3], [[4, 4], [2, 2], [6, 6]])
    micro = MicroBatches(groups_per_mini_batch=3, micro_batch_size=4, share_prompts=True)
    (mini,) = micro.mini_batches(whole)
    passes = list(micro.passes(whole, mini))
    groups = [whole.group_ids[p.rows].tolist() for p in passes]
    assert groups == [[1, 1, 0, 0], [2, 2]]


def test_sharing_prompts_splits_a_group_bigger_than_a_pass() -> None:
    whole = grouped_batch([3, 3], [[1, 2, 3, 4, 5], [1]])
    micro = MicroBatches(groups_per_mini_batch=2, micro_batch_size=2, share_prompts=True)
    (mini,) = micro.mini_batches(whole)
    passes = list(micro.passes(whole, mini))
    assert sorted(torch.cat([p.rows for p in passes]).tolist()) == list(range(6))
    assert all(len(p.rows) <= 2 for p in passes)


def test_sharing_prompts_under_a_token_budget_counts_packed_tokens() -> None:
    # packed lengths 10 (4 + 6), 7 (4 + 3), 12 (4 + 8); a budget of 20 tokens a pass
    whole = grouped_batch([4, 4, 4], [[3, 3], [1, 2], [4, 4]])
    micro = MicroBatches(groups_per_mini_batch=3, micro_batch_size=1, max_token_len=20,
                         share_prompts=True)
    (mini,) = micro.mini_batches(whole)
    passes = list(micro.passes(whole, mini))
    # sorted 7 | 10: 2 x 10 = 20 fits; 12: 3 x 12 > 20
    assert [whole.group_ids[p.rows].unique_consecutive().tolist() for p in passes] == [[1, 0], [2]]
    # a group longer than the budget is split, each part within it (4 + 3 + 3 > 8)
    micro = MicroBatches(groups_per_mini_batch=3, micro_batch_size=1, max_token_len=8,
                         share_prompts=True)
    passes = list(micro.passes(whole, mini))
    assert sorted(torch.cat([p.rows for p in passes]).tolist()) == list(range(6))
    assert max(len(p.rows) for p in passes) <= 2


def test_a_rank_with_fewer_rows_pads_with_a_zero_weight_pass_of_a_row_of_its_own() -> None:
    """Rank 1 of 2 holds rows 1 and 3 of a 5-row mini-batch, one a pass, where rank 0 needs
    three passes: its third pass is a stand-in over its first row (by length), whose width
    its cut read (no host read of its own)."""
    micro = MicroBatches(groups_per_mini_batch=5, micro_batch_size=1)
    micro.rank, micro.world = 1, 2  # as a rank of two would see it (no collective needed)
    whole = batch()
    passes = list(micro.passes(whole, torch.arange(5)))
    assert [p.weight for p in passes] == [1.0, 1.0, 0.0]
    assert [p.rows.tolist() for p in passes] == [[1], [3], [1]]
    assert passes[2].part.input_ids.tolist() == whole.select(torch.tensor([1])).input_ids.tolist()
    assert not passes[2].owned()
