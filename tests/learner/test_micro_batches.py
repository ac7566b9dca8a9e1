"""learner.micro_batches: passes hold rows of like length, by row count or by token budget,
and every row of a mini-batch is in exactly one pass."""

from __future__ import annotations

import torch

from learner.batch import TrainBatch
from learner.micro_batches import MicroBatches

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


def test_a_row_longer_than_the_budget_gets_a_pass_of_its_own() -> None:
    micro = MicroBatches(groups_per_mini_batch=5, micro_batch_size=1, max_token_len=10)
    whole = batch()
    (mini,) = micro.mini_batches(whole)
    passes = list(micro.passes(whole, mini))
    assert [p.part.input_ids.shape[1] for p in passes][-1] == 12
    assert len(passes[-1].rows) == 1
