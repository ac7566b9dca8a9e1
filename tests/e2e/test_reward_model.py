"""The embedded default trains with a learned reward beside its rule reward
(``reward_model.combine = "add"``), a few steps through the real launcher each (slow: about
a minute each):

- a discriminative reward model (``reward_model.enable``): its scores in the metrics, and
  every sample's reward the rule's plus the reward model's, which is a plain transformers
  forward of prompt + response;
- an LLM judge served by the lean engine in each generator (``reward_model.judge``): its
  scores in the metrics, each in [0, 1], and every sample's reward the rule's plus the
  judge's;
- the reward model in a reward server of its own (a ``[[reward_models]]`` process) that the
  generator calls: the same scores, and the server's log counts what it scored;
- a judge served by vLLM's CPU build in a reward server beside the lean generator (when vLLM
  is installed; its CPU attention needs heads of 32 or more, so the judge is a random Llama
  with 4 heads of 32).
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForSequenceClassification, LlamaConfig, \
    LlamaForSequenceClassification

from relay.buffer.rollout_log import read_rollout_log
from relay.configs import CONFIG_DIR, DEFAULT_TOPOLOGY
from relay.learner.tiny_model.tokenizer import build_tokenizer
from relay.transport.messages import Sample

from ..conftest import save_random_model
from .conftest import launch, only_run_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 3
FREE_PORTS = ["topology.buffer.port=0", "topology.learner.weights_port=0",
              "topology.learner.weights_stream_port=0", "topology.launcher.metrics_port=0"]


def save_reward_model(folder: Path) -> Path:
    """A small random sequence-classification model on the tiny model's tokenizer."""
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("where", ["generator", "reward server"])
def test_the_default_trains_with_a_reward_model_beside_the_rule(run_root: Path,
                                                                tmp_path: Path,
                                                                where: str) -> None:
    """In each generator (no ``[[reward_models]]``) or in a reward server of its own."""
    rm_path = save_reward_model(tmp_path / "rm")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    servers = ['topology.reward_models=[{name = "rm0", threads = 1}]'] \
        if where == "reward server" else []
    result = launch([str(DEFAULT_TOPOLOGY), str(CONFIG_DIR / "arithmetic-grpo.toml"),
                     f"trainer.run_dir={run_root}", *FREE_PORTS, f"tracking.uri={uri}",
                     f"trainer.total_training_steps={STEPS}", "trainer.test_freq=-1",
                     *servers, "reward_model.enable=true",
                     f"reward_model.model.path={rm_path}", "reward_model.combine=add",
                     "reward_model.micro_batch_size_per_gpu=4"],
                    timeout_s=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"trained {STEPS} steps" in result.stdout

    samples = logged_samples(uri, run_root, "rollout/rm_score_mean")
    for sample in samples:
        info = sample.reward_info
        assert sample.reward == pytest.approx(info["rule_score"] + info["rm_score"], abs=1e-6)
    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    with torch.no_grad():
        for sample in samples[:8]:
            ids = torch.cat([sample.prompt_ids, sample.response_ids]).long()[None]
            assert float(model(input_ids=ids).logits[0, 0]) == pytest.approx(
                sample.reward_info["rm_score"], abs=1e-5)
    if where == "reward server":
        log = (only_run_dir(run_root) / "logs" / "rm0.log").read_text()
        served = re.search(r"reward server rm0 done: (\d+) requests served, (\d+) "
                           r"responses scored", log)
        assert served is not None, log[-2000:]
        assert int(served.group(2)) >= len(samples) > 0  # every sample scored by the server
        assert "serving the reward model" in log


def test_the_default_trains_with_a_judge_on_the_lean_engine(run_root: Path, tmp_path: Path,
                                                            random_model_dir: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = launch([str(DEFAULT_TOPOLOGY), str(CONFIG_DIR / "arithmetic-grpo.toml"),
                     f"trainer.run_dir={run_root}", *FREE_PORTS, f"tracking.uri={uri}",
                     f"trainer.total_training_steps={STEPS}", "trainer.test_freq=-1",
                     "reward_model.judge.enable=true",
                     f"reward_model.judge.model={random_model_dir}",
                     "reward_model.judge.max_new_tokens=4", "reward_model.combine=add"],
                    timeout_s=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for sample in logged_samples(uri, run_root, "rollout/judge_score_mean"):
        info = sample.reward_info
        assert 0.0 <= info["judge_score"] <= 1.0
        assert sample.reward == pytest.approx(info["rule_score"] + info["judge_score"],
                                              abs=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed (the `vllm` extra)")
def test_the_default_trains_with_a_vllm_judge_in_a_reward_server(run_root: Path,
                                                                 tmp_path: Path) -> None:
    judge = save_random_model(tmp_path / "judge", hidden=128)  # 4 heads of 32
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = launch([str(DEFAULT_TOPOLOGY), str(CONFIG_DIR / "arithmetic-grpo.toml"),
                     f"trainer.run_dir={run_root}", *FREE_PORTS, f"tracking.uri={uri}",
                     f"trainer.total_training_steps={STEPS}", "trainer.test_freq=-1",
                     'topology.reward_models=[{name = "judge0", threads = 1, '
                     'vllm = {kv_cache_gib = 0.25}}]',
                     "reward_model.judge.enable=true", f"reward_model.judge.model={judge}",
                     "reward_model.judge.engine=vllm", "reward_model.judge.max_new_tokens=4",
                     "reward_model.judge.max_prompt_length=96",
                     "reward_model.judge.prompt_template=Grade {response} from 0 to 1:",
                     "reward_model.combine=add"], timeout_s=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    samples = logged_samples(uri, run_root, "rollout/judge_score_mean")
    for sample in samples:
        info = sample.reward_info
        assert 0.0 <= info["judge_score"] <= 1.0
        assert sample.reward == pytest.approx(info["rule_score"] + info["judge_score"],
                                              abs=1e-6)
    assert not any("max_prompt_length" in s.reward_error for s in samples)  # all asked
    log = (only_run_dir(run_root) / "logs" / "judge0.log").read_text()
    assert "serving the judge" in log
    served = re.search(r"reward server judge0 done: \d+ requests served, (\d+) responses",
                       log)
    assert served is not None and int(served.group(1)) >= len(samples), log[-2000:]


def logged_samples(uri: str, run_root: Path, learned_metric: str) -> list[Sample]:
    """The run's samples from its rollout log, once MLflow holds a finite value of the
    learned score's metric, the rule's and the actor's loss for every step."""
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("relay-arithmetic")
                                 .experiment_id])
    for name in (learned_metric, "rollout/rule_score_mean", "actor/loss"):
        history = client.get_metric_history(run.info.run_id, name)
        assert len(history) == STEPS and all(math.isfinite(m.value) for m in history), name
    samples = [s for g in read_rollout_log(only_run_dir(run_root) / "rollouts")
               for s in g.samples]
    assert samples
    return samples
