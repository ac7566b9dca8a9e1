"""The discriminative reward model: Relay's scores equal a plain transformers forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import (AutoModelForSequenceClassification, LlamaConfig,
                          LlamaForCausalLM, LlamaForSequenceClassification,
                          LlamaForTokenClassification)

from relay.algorithms.rewards.result import RewardResult
from relay.configs.run_schema import PrmModelConfig, RewardModelConfig
from relay.generators.reward_model import (RewardModelError, RewardModelScorer, combined,
                                           load_reward_model, score_sequences)
from relay.learner.tiny_model.tokenizer import build_tokenizer


def tiny_config(tokenizer, num_labels: int = 1) -> LlamaConfig:
    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=128, num_labels=num_labels,
                       pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id)


def save_rm(folder: Path, cls=LlamaForSequenceClassification, num_labels: int = 1) -> Path:
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = cls(tiny_config(tokenizer, num_labels))
    with torch.no_grad():  # a random head is near zero; make the scores tell texts apart
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_rm(tmp_path_factory.mktemp("rm"))


TEXTS = ["12+7=19", "3*4 is 12, so <answer>12</answer>", "no", "a much longer text " * 6]


def reference(path: Path, ids: list[list[int]]) -> list[float]:
    """Each sequence alone through transformers' own forward (no padding)."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([seq])).logits[0, 0]) for seq in ids]


def test_scores_equal_transformers_forward_in_any_batch(rm_dir: Path) -> None:
    tokenizer = build_tokenizer()
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    assert len({len(seq) for seq in ids}) == len(ids)  # different lengths: padding matters
    expected = reference(rm_dir, ids)
    model = load_reward_model(str(rm_dir))
    for micro in (1, 3, 8):
        got = score_sequences(model, ids, micro_batch_size=micro, pad_id=tokenizer.pad_token_id)
        assert got == pytest.approx(expected, abs=1e-5)
    assert max(expected) - min(expected) > 1e-2


def test_token_classification_scores_the_last_token(tmp_path: Path) -> None:
    path = save_rm(tmp_path / "tok", cls=LlamaForTokenClassification)
    tokenizer = build_tokenizer()
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    plain = LlamaForTokenClassification.from_pretrained(path).eval()
    with torch.no_grad():
        expected = [float(plain(input_ids=torch.tensor([s])).logits[0, -1, 0]) for s in ids]
    got = score_sequences(load_reward_model(str(path)), ids, micro_batch_size=4, pad_id=0)
    assert got == pytest.approx(expected, abs=1e-5)


def test_a_causal_lm_with_trls_value_head(tmp_path: Path) -> None:
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    lm = LlamaForCausalLM(tiny_config(tokenizer))
    lm.save_pretrained(tmp_path / "vh")
    head = {"v_head.summary.weight": torch.randn(1, 32), "v_head.summary.bias": torch.randn(1)}
    save_file(head, str(tmp_path / "vh" / "value_head.safetensors"))
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    with torch.no_grad():
        expected = [float(lm.model(input_ids=torch.tensor([s])).last_hidden_state[0, -1]
                          @ head["v_head.summary.weight"][0] + head["v_head.summary.bias"][0])
                    for s in ids]
    got = score_sequences(load_reward_model(str(tmp_path / "vh")), ids, micro_batch_size=3,
                          pad_id=0)
    assert got == pytest.approx(expected, abs=1e-5)


def test_max_length_cuts_on_the_right(rm_dir: Path) -> None:
    tokenizer = build_tokenizer()
    seq = tokenizer(TEXTS[3], add_special_tokens=False)["input_ids"]
    model = load_reward_model(str(rm_dir))
    cut = score_sequences(model, [seq], micro_batch_size=2, pad_id=0, max_length=5)
    assert cut == pytest.approx(reference(rm_dir, [seq[:5]]), abs=1e-5)


def test_scorer_reads_policy_ids_or_rerenders_the_chat(rm_dir: Path) -> None:
    tokenizer = build_tokenizer()
    messages = [{"role": "user", "content": "What is 12+7?"}]
    prompt_ids = tokenizer.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=True)
    prompt_ids = tokenizer(prompt_ids, add_special_tokens=False)["input_ids"]
    responses = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS[:2]]
    same = RewardModelScorer(RewardModelConfig(enable=True, model=PrmModelConfig(
        path=str(rm_dir)), micro_batch_size_per_gpu=2), "cpu")
    assert same.score(messages, prompt_ids, responses, TEXTS[:2]) == pytest.approx(
        reference(rm_dir, [[*prompt_ids, *r] for r in responses]), abs=1e-5)
    own = RewardModelScorer(RewardModelConfig(enable=True, model=PrmModelConfig(
        path=str(rm_dir), input_tokenizer="policy")), "cpu")
    rendered = [tokenizer(tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": t}], tokenize=False),
        add_special_tokens=False)["input_ids"] for t in TEXTS[:2]]
    assert own.score(messages, prompt_ids, responses, TEXTS[:2]) == pytest.approx(
        reference(rm_dir, rendered), abs=1e-5)


def test_layouts_refused_with_the_reason(tmp_path: Path) -> None:
    tokenizer = build_tokenizer()
    LlamaForCausalLM(tiny_config(tokenizer)).save_pretrained(tmp_path / "lm")
    with pytest.raises(RewardModelError, match="TRL's value head"):
        load_reward_model(str(tmp_path / "lm"))
    save_rm(tmp_path / "two", num_labels=2)
    with pytest.raises(RewardModelError, match="num_labels = 2"):
        load_reward_model(str(tmp_path / "two"))
    with pytest.raises(RewardModelError, match="reward_model.model.path"):
        RewardModelScorer(RewardModelConfig(enable=True), "cpu")


def test_combined_replaces_or_adds_and_records_both() -> None:
    rule = RewardResult(score=1.0, info={"format_ok": 1.0})
    replaced = combined(rule, 0.25, "replace")
    assert replaced.score == 0.25
    assert replaced.info == {"format_ok": 1.0, "rule_score": 1.0, "rm_score": 0.25}
    assert combined(rule, 0.25, "add").score == 1.25


def test_combined_keeps_a_judges_score_and_both_errors() -> None:
    rule = RewardResult(score=1.0, error="rule: bad")
    judged = combined(rule, 0.0, "add", key="judge_score", error="judge: no number")
    assert judged.info == {"rule_score": 1.0, "judge_score": 0.0}
    assert judged.error == "rule: bad; judge: no number" and judged.score == 1.0
