"""relay.learner.shared_prompts: a prompt group as one sequence gives the row layout's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen2Config

from relay.learner.batch import TrainBatch, collate
from relay.learner.model import enable_activation_checkpointing, forward_logprobs
from relay.learner.shared_prompts import EXPLICIT_ATTENTION_MAX_KEYS, pack, row_attention, unsupported
from relay.transport.messages import RolloutGroup, Sample


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
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 2, 3, 0, 1, 2, 3, 4]]
    # row 1 (prompt 5 6, response 8 9) reads packed positions 0 1 3 4
    assert packed.source[1].tolist() == [0, 1, 3, 4, 0]
    assert packed.source[2].tolist() == [5, 6, 7, 8, 9]


def test_attention_rows_hold_each_prompt_once_and_each_response_with_its_prompt() -> None:
    prompts, responses = pack(small_batch()).rows

    def valid(rows) -> list[list[int]]:
        return [index[ok].tolist() for index, ok in zip(rows.query_index, rows.query_valid)]

    # a prompt row per sequence: the prompt's queries and keys, causal
    assert valid(prompts) == [[0, 1], [5, 6, 7]]
    assert prompts.key_index[0, :2].tolist() == [0, 1]
    assert prompts.key_index[1].tolist() == [5, 6, 7]
    assert prompts.attend[0, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 0]]
    assert prompts.attend[1, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    # a response row per sample: its response's queries, its prompt's and response's keys
    assert valid(responses) == [[2], [3, 4], [8, 9]]
    assert responses.key_index.tolist() == [[0, 1, 2, 0, 0], [0, 1, 3, 4, 0], [5, 6, 7, 8, 9]]
    # row 1's queries (response 8 9, row positions 2 3) see the prompt and their response
    assert responses.attend[1, 0].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    # row 0's one query (response 7) sees its prompt and itself; its padding query key 0
    assert responses.attend[0, 0].int().tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    for rows in (prompts, responses):
        # the same mask as an additive bias, and the real queries as flat indices and targets
        assert bool(((rows.bias == 0) == rows.attend).all())
        assert bool((rows.bias[~rows.attend] == float("-inf")).all())
        assert rows.query_targets.tolist() == sum(valid(rows), [])
        assert rows.query_index.flatten()[rows.valid_queries].tolist() == sum(valid(rows), [])


def test_rows_of_a_group_with_different_prompts_get_sequences_of_their_own() -> None:
    packed = pack(collate([group("a", [[5, 6], [5, 7]], [[8], [9]])], pad_id=0))
    assert packed.input_ids.tolist() == [[5, 6, 8, 5, 7, 9]]


def test_logits_are_asked_only_where_a_response_token_is_predicted() -> None:
    batch = small_batch()
    packed = pack(batch)
    # row 0 (prompt 5 6) predicts 7 from packed position 1; row 1 predicts 8 from the same
    # shared prompt position and 9 from position 3; row 2 predicts 13 14 from 7 and 8
    assert packed.predictors.tolist() == [1, 1, 3, 7, 8]
    assert packed.labels(batch).tolist() == [7, 8, 9, 13, 14]
    grid = packed.to_grid(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), (3, 4))
    assert grid.tolist() == [[0, 1, 0, 0], [0, 2, 3, 0], [0, 0, 4, 5]]
    assert bool(((grid != 0) == (batch.response_mask > 0)).all())


def test_a_multi_turn_episodes_inserted_tokens_are_context_not_predictions() -> None:
    """Row 1's response 8 30 9 has an inserted token 30 (loss mask False): it is packed as
    context (its position is there, row 1's 9 attends to it) but nothing predicts it, so the
    grid is zero there as in the row layout."""
    episode = group("a", [[5, 6]] * 2, [[7], [8, 30, 9]])
    episode.samples[1].loss_mask = torch.tensor([True, False, True])
    batch = collate([episode, group("b", [[10, 11, 12]], [[13, 14]])], pad_id=0)
    packed = pack(batch)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 30, 9, 10, 11, 12, 13, 14]]
    assert packed.predictors.tolist() == [1, 1, 4, 8, 9]
    assert packed.labels(batch).tolist() == [7, 8, 9, 13, 14]
    grid = packed.to_grid(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), (3, 4))
    assert bool(((grid != 0) == (batch.response_mask > 0)).all())


@pytest.mark.parametrize("keys", [7, EXPLICIT_ATTENTION_MAX_KEYS + 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_attention_gives_sdpa_values_and_gradients(keys: int, dtype: torch.dtype) -> None:
    """Short rows take explicit matmuls, long ones SDPA; both give SDPA's attention (GQA:
    query head h reads key/value head h // 2) and its gradients, to the dtype's rounding."""
    generator = torch.Generator().manual_seed(keys)
    shapes = {"query": (3, 4, keys, 8), "key": (3, 2, keys, 8), "value": (3, 2, keys, 8)}
    inputs = {name: torch.randn(shape, generator=generator).to(dtype).requires_grad_()
              for name, shape in shapes.items()}
    causal = torch.ones(keys, keys, dtype=torch.bool).tril()
    attend = (causal & (torch.rand(3, 1, keys, keys, generator=generator) > 0.3)) \
        | torch.eye(keys, dtype=torch.bool)  # every query keeps at least its own key
    weights = torch.randn(3, 4, keys, 8, generator=generator)

    def values_and_gradients(function) -> list[torch.Tensor]:
        out = function(**inputs)
        grads = torch.autograd.grad((out.float() * weights).sum(), list(inputs.values()))
        return [out.float(), *(g.float() for g in grads)]

    ours = values_and_gradients(lambda **x: row_attention(**x, attend=attend, scale=0.3))
    sdpa = values_and_gradients(lambda query, key, value: F.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=attend, scale=0.3,
        enable_gqa=True))
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for mine, reference in zip(ours, sdpa, strict=True):
        torch.testing.assert_close(mine, reference, atol=tolerance, rtol=tolerance)


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


@pytest.mark.parametrize("model_type", ["llama", "llama-head-dim-16", "qwen2"])
def test_packed_log_probs_entropy_and_gradients_equal_the_rows(
        tmp_path: Path, model_type: str) -> None:
    model = small_model(tmp_path, model_type)
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
    assert model.config._attn_implementation == "relay"  # relay.learner.attention picks per pass


def test_gradient_checkpointing_recomputes_the_shared_prompt_pass(tmp_path: Path) -> None:
    """The backward runs each block's forward again: it must take the packed path too."""
    model = small_model(tmp_path, "llama")
    batch = random_rollouts(1)
    results = []
    for checkpointing in (False, True):
        if checkpointing:
            enable_activation_checkpointing(model)
        model.train()
        model.zero_grad()
        logprobs, _ = forward_logprobs(model, batch, 1.0, False, share_prompts=True)
        (logprobs * batch.response_mask).sum().backward()
        results.append([p.grad.clone() for p in model.parameters()])
    for plain, recomputed in zip(*results, strict=True):
        torch.testing.assert_close(recomputed, plain, atol=1e-5, rtol=1e-4)


def small_model(folder: Path, model_type: str) -> torch.nn.Module:
    """A random Llama (MHA; with ``llama-head-dim-16`` heads of 16, not hidden 32 / 4 heads,
    as the tiny model's explicit head_dim) or Qwen2 (GQA, q/k/v biases) over the tiny
    vocabulary."""
    shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    if model_type == "qwen2":
        config = Qwen2Config(num_key_value_heads=2, **shape)
    else:
        head_dim = 16 if model_type == "llama-head-dim-16" else None
        config = LlamaConfig(num_key_value_heads=4, head_dim=head_dim, **shape)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                attn_implementation="relay")


def test_only_plain_causal_attention_shares_prompts() -> None:
    assert unsupported(LlamaConfig()) is None
    assert unsupported(Qwen2Config()) is None
    assert "sliding" in unsupported(Qwen2Config(use_sliding_window=True, sliding_window=8))
    assert "gemma2" in unsupported(Gemma2Config())
