"""The SGLang adapter (``relay.generators.sglang_engine``) driven by a fake ``sglang.Engine``:
SGLang itself needs CUDA GPUs and is not installed here. The fake records every call and
answers ``generate`` with outputs shaped like SGLang's (``output_ids`` and
``meta_info["output_token_logprobs"]`` of ``(logprob, token_id, text)``)."""

from __future__ import annotations

import sys
import types
from collections import deque
from pathlib import Path

import pytest
import torch

from relay.configs import load_topology
from relay.configs.run_schema import ModelConfig
from relay.configs.topology_schema import SGLangOptions
from relay.generators import sglang_engine
from relay.generators.build import build_engine
from relay.generators.engine import GroupRequest, WeightMismatch
from relay.generators.hf_layout import parameter_shapes
from relay.generators.sampling import SamplingParams
from relay.generators.sglang_engine import (
    SGLangEngine,
    SGLangUnavailable,
    completion_of,
    engine_arguments,
    import_sglang,
    request_params,
)

EOS = 2
SAMPLED = SamplingParams(max_new_tokens=4, temperature=0.7)
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)
SHAPES = {"model.embed_tokens.weight": torch.Size([5, 3]), "model.norm.weight": torch.Size([3])}


def sglang_output(tokens: list[int], logprobs: list[float], reason: str,
                  trim_stop: bool = False) -> dict:
    """One SGLang output; ``trim_stop`` drops the stop token from ``output_ids`` as SGLang's
    detokenizer does when it does not honour ``no_stop_trim``."""
    finish = {"type": "stop", "matched": tokens[-1]} if reason == "stop" else \
        {"type": reason, "length": len(tokens)}
    return {"output_ids": tokens[:-1] if trim_stop else list(tokens),
            "meta_info": {"finish_reason": finish,
                          "output_token_logprobs": [(lp, t, None)
                                                    for lp, t in zip(logprobs, tokens)]}}


class FakeSGLang:
    """Stands in for ``sglang.Engine``: keeps its constructor's arguments, answers each
    prompt of ``generate`` with the next queued output, records weight updates."""

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.replies: deque[dict] = deque()
        self.generate_calls: list[dict] = []
        self.updates: list[dict] = []
        self.update_result = (True, "ok")

    def generate(self, *, input_ids, sampling_params, return_logprob):
        self.generate_calls.append(dict(input_ids=input_ids, sampling_params=sampling_params,
                                        return_logprob=return_logprob))
        return [self.replies.popleft() for _ in input_ids]

    def update_weights_from_tensor(self, *, named_tensors, flush_cache):
        self.updates.append(dict(named_tensors=named_tensors, flush_cache=flush_cache))
        return self.update_result


def adapter(fake: FakeSGLang, seed: int = 5, device: str = "cpu") -> SGLangEngine:
    return SGLangEngine(fake, shapes=SHAPES, tied_embeddings=True, eos_ids=[EOS, 9], seed=seed,
                        device=device)


def new_weights() -> dict[str, torch.Tensor]:
    return {name: torch.randn(shape) for name, shape in SHAPES.items()}


# ---- conversions ----------------------------------------------------------------------------

def test_engine_arguments_map_verl_names_and_pass_engine_kwargs_last() -> None:
    options = SGLangOptions(gpu_memory_utilization=0.7, tensor_model_parallel_size=2,
                            enforce_eager=False, max_num_batched_tokens=4096,
                            engine_kwargs={"enable_deterministic_inference": True,
                                           "mem_fraction_static": 0.8})
    args = engine_arguments("/m", dtype="bfloat16", device="cuda:1", seed=3, max_num_seqs=64,
                            max_len=1536, trust_remote_code=True, options=options)
    assert args == dict(model_path="/m", skip_tokenizer_init=True, dtype="bfloat16",
                        random_seed=3, trust_remote_code=True, device="cuda", base_gpu_id=1,
                        max_running_requests=64, context_length=1536,
                        mem_fraction_static=0.8,  # engine_kwargs win over the named option
                        tp_size=2, disable_cuda_graph=False, chunked_prefill_size=4096,
                        enable_deterministic_inference=True)


def test_engine_arguments_context_length_and_chunked_prefill_off() -> None:
    options = SGLangOptions(max_model_len=4096, enable_chunked_prefill=False)
    args = engine_arguments("/m", dtype="float32", device="cuda", seed=0, max_num_seqs=8,
                            max_len=512, trust_remote_code=False, options=options)
    assert args["context_length"] == 4096
    assert args["chunked_prefill_size"] == -1
    assert args["disable_cuda_graph"] is True and args["mem_fraction_static"] == 0.5
    assert "base_gpu_id" not in args and args["device"] == "cuda"


def test_request_params_stop_at_eos_keep_it_and_seed_each_sequence() -> None:
    params = request_params(SAMPLED, seed=2**31 + 7, eos_ids=[EOS, 9])
    assert params == dict(max_new_tokens=4, temperature=0.7, stop_token_ids=[EOS, 9],
                          no_stop_trim=True, sampling_seed=7, top_p=1.0, top_k=-1)


@pytest.mark.parametrize("setting, passed", [(dict(top_p=0.9), dict(top_p=0.9, top_k=-1)),
                                             (dict(top_k=20), dict(top_p=1.0, top_k=20)),
                                             (dict(top_k=0), dict(top_p=1.0, top_k=-1))])
def test_request_params_pass_top_p_and_top_k_through(setting, passed) -> None:
    """SGLang's log-probs are the temperature-only ones whatever the filters (module
    docstring): issue 30, item 20 makes that Relay's convention, so top-p / top-k run."""
    params = request_params(SamplingParams(max_new_tokens=4, temperature=0.7, **setting), 0,
                            [EOS])
    assert {key: params[key] for key in passed} == passed


def test_greedy_request_params_carry_no_filters() -> None:
    greedy = request_params(SamplingParams(max_new_tokens=2, temperature=0.0, top_p=0.5,
                                           top_k=3), 0, [EOS])
    assert greedy["temperature"] == 0.0 and "top_p" not in greedy and "top_k" not in greedy


@pytest.mark.parametrize("value", ["1", "True", "true"])
def test_original_logprobs_are_refused_away_from_temperature_one(
        monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", value)
    with pytest.raises(ValueError, match="SGLANG_RETURN_ORIGINAL_LOGPROB.*rollout.temperature"):
        request_params(SAMPLED, 0, [EOS])
    assert request_params(SamplingParams(max_new_tokens=4), 0, [EOS])["temperature"] == 1.0
    assert request_params(GREEDY, 0, [EOS])["temperature"] == 0.0
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "0")
    assert request_params(SAMPLED, 0, [EOS])["temperature"] == 0.7


@pytest.mark.parametrize("trim_stop", [False, True])
def test_completion_keeps_the_eos_token_whether_or_not_sglang_trimmed_it(trim_stop) -> None:
    output = sglang_output([11, 12, EOS], [-0.5, -1.25, -0.125], "stop", trim_stop)
    completion = completion_of(output, greedy=False, version=3)
    assert completion.token_ids.tolist() == [11, 12, EOS]
    assert completion.token_ids.dtype == torch.int32
    assert completion.logprobs.tolist() == [-0.5, -1.25, -0.125]
    assert completion.logprobs.dtype == torch.float32
    assert completion.versions.tolist() == [3, 3, 3] and completion.versions.dtype == torch.int32
    assert completion.finish_reason == "stop"


def test_completion_length_and_greedy_log_probs_are_zero() -> None:
    completion = completion_of(sglang_output([11, 12], [-0.3, -0.2], "length"), greedy=True,
                               version=0)
    assert completion.finish_reason == "length"
    assert completion.logprobs.tolist() == [0.0, 0.0]


def test_completion_refuses_aborted_requests_and_disagreeing_outputs() -> None:
    with pytest.raises(RuntimeError, match="abort"):
        completion_of(sglang_output([11], [-0.1], "abort"), greedy=False, version=0)
    output = sglang_output([11, 12], [-0.1, -0.2], "length")
    output["output_ids"] = [11, 13]
    with pytest.raises(RuntimeError, match="not the sampled tokens"):
        completion_of(output, greedy=False, version=0)


# ---- the adapter ----------------------------------------------------------------------------

def test_a_group_of_n_is_n_sglang_requests_with_their_own_seeds() -> None:
    fake = FakeSGLang()
    fake.replies.extend([sglang_output([11, EOS], [-0.1, -0.2], "stop"),
                         sglang_output([12, 13, 14, 15], [-0.3] * 4, "length"),
                         sglang_output([16, 9], [-0.4, -0.5], "stop")])
    engine = adapter(fake, seed=5)
    engine.submit(GroupRequest("g", [1, 7, 8], 3, SAMPLED))
    assert engine.in_flight == 3
    [group] = engine.step()
    [call] = fake.generate_calls
    assert call["input_ids"] == [[1, 7, 8]] * 3 and call["return_logprob"] is True
    assert [p["sampling_seed"] for p in call["sampling_params"]] == [5, 6, 7]
    assert group.key == "g"
    assert [c.token_ids.tolist() for c in group.completions] == [[11, EOS], [12, 13, 14, 15],
                                                                 [16, 9]]
    assert [c.finish_reason for c in group.completions] == ["stop", "length", "stop"]
    assert engine.in_flight == 0


def test_reseed_restarts_the_sequence_seeds() -> None:
    fake = FakeSGLang()
    fake.replies.extend(sglang_output([11], [-0.1], "length") for _ in range(3))
    engine = adapter(fake, seed=5)
    engine.generate([[1, 4]], SAMPLED)
    engine.reseed(40)
    engine.generate([[1, 4], [1, 5]], SAMPLED)
    assert [[p["sampling_seed"] for p in c["sampling_params"]]
            for c in fake.generate_calls] == [[5], [40, 41]]


def test_greedy_completions_have_zero_log_probs() -> None:
    fake = FakeSGLang()
    fake.replies.append(sglang_output([11, EOS], [-0.7, -0.9], "stop"))
    [completion] = adapter(fake).generate([[1, 4]], GREEDY)
    assert completion.logprobs.tolist() == [0.0, 0.0]
    assert fake.generate_calls[0]["sampling_params"][0]["temperature"] == 0.0


def test_top_p_sampling_reaches_sglang_and_keeps_its_log_probs() -> None:
    fake = FakeSGLang()
    fake.replies.append(sglang_output([11, EOS], [-0.7, -0.9], "stop"))
    [completion] = adapter(fake).generate([[1, 4]], SamplingParams(max_new_tokens=4,
                                                                   top_p=0.95))
    assert fake.generate_calls[0]["sampling_params"][0]["top_p"] == 0.95
    torch.testing.assert_close(completion.logprobs, torch.tensor([-0.7, -0.9]))


def test_every_token_carries_the_version_held_when_the_call_began() -> None:
    fake = FakeSGLang()
    fake.replies.extend([sglang_output([11, 12], [-0.1, -0.2], "length"),
                         sglang_output([13, EOS], [-0.3, -0.4], "stop")])
    engine = adapter(fake)
    [before] = engine.generate([[1, 4]], SAMPLED)
    engine.load_weights(4, new_weights())
    [after] = engine.generate([[1, 4]], SAMPLED)
    assert before.versions.tolist() == [0, 0]
    assert after.versions.tolist() == [4, 4]


def test_load_weights_sends_hf_names_with_lm_head_for_tied_embeddings() -> None:
    """On the CPU: the host tensors, in one call."""
    fake = FakeSGLang()
    engine = adapter(fake)
    tensors = new_weights()
    engine.load_weights(2, tensors)
    [update] = fake.updates
    sent = dict(update["named_tensors"])
    assert sorted(sent) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    assert sent["lm_head.weight"] is tensors["model.embed_tokens.weight"]
    assert update["flush_cache"] is True
    assert engine.version == 2


def test_on_a_gpu_the_version_goes_in_chunks_of_device_tensors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine on a device other than the CPU ("meta" stands in for CUDA here) gets the
    version as tensors on its device, at most WEIGHT_CHUNK_BYTES a call (a larger tensor
    alone), the prefix cache flushed with the last chunk only."""
    monkeypatch.setattr(sglang_engine, "WEIGHT_CHUNK_BYTES", 40)
    fake = FakeSGLang()
    engine = adapter(fake, device="meta")
    tensors = new_weights()  # embed 60 bytes, norm 12 (lm_head: the embed again)
    engine.load_weights(3, tensors)
    assert [[name for name, _ in update["named_tensors"]] for update in fake.updates] == [
        ["model.embed_tokens.weight"], ["model.norm.weight"], ["lm_head.weight"]]
    assert [update["flush_cache"] for update in fake.updates] == [False, False, True]
    for update in fake.updates:
        for name, tensor in update["named_tensors"]:
            assert tensor.device.type == "meta" and tensor.shape == tensors.get(
                name, tensors["model.embed_tokens.weight"]).shape
    assert engine.version == 3


def test_a_chunk_sglang_refuses_after_another_was_loaded_says_to_restart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_engine, "WEIGHT_CHUNK_BYTES", 40)
    fake = FakeSGLang()
    results = iter([(True, "ok"), (False, "out of memory")])
    fake.update_weights_from_tensor = lambda **kwargs: next(results)
    engine = adapter(fake, device="meta")
    with pytest.raises(RuntimeError, match="version 1: out of memory. SGLang now holds part "
                                           "of it: restart this generator"):
        engine.load_weights(1, new_weights())
    assert engine.version == 0


@pytest.mark.parametrize("break_it", ["missing", "extra", "shape"])
def test_mismatched_weights_change_nothing(break_it) -> None:
    fake = FakeSGLang()
    engine = adapter(fake)
    tensors = new_weights()
    if break_it == "missing":
        del tensors["model.norm.weight"]
    elif break_it == "extra":
        tensors["model.layers.0.bias"] = torch.zeros(3)
    else:
        tensors["model.norm.weight"] = torch.zeros(4)
    with pytest.raises(WeightMismatch):
        engine.load_weights(1, tensors)
    assert fake.updates == [] and engine.version == 0


def test_a_weight_update_sglang_refuses_keeps_the_old_version() -> None:
    fake = FakeSGLang()
    fake.update_result = (False, "shape mismatch in layer 3")
    engine = adapter(fake)
    with pytest.raises(RuntimeError, match="shape mismatch in layer 3"):
        engine.load_weights(1, new_weights())
    assert engine.version == 0


# ---- SGLang missing, and building from a topology --------------------------------------------

def test_import_sglang_says_where_sglang_runs(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)  # makes `import sglang` fail
    with pytest.raises(SGLangUnavailable) as info:
        import_sglang()
    message = str(info.value)
    assert "CUDA GPUs" in message and "Intel AMX" in message and "engine \"lean\"" in message


SGLANG_TOPOLOGY = """
[[generators]]
name = "g"
engine = "sglang"
device = "cuda:2"

[generators.sglang]
gpu_memory_utilization = 0.6
tensor_model_parallel_size = 2
engine_kwargs = { enable_deterministic_inference = true }
"""


def sglang_placement(tmp_path: Path):
    path = tmp_path / "topology.toml"
    path.write_text(SGLANG_TOPOLOGY)
    return load_topology(path).generators[0]


def test_build_engine_raises_sglang_unavailable_without_sglang(monkeypatch, tmp_path,
                                                               random_model_dir) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(SGLangUnavailable, match="CUDA GPUs"):
        build_engine(ModelConfig(path=str(random_model_dir), dtype="float32"),
                     sglang_placement(tmp_path), seed=0, max_num_seqs=4, max_len=64)


def test_build_engine_starts_sglang_with_the_topology_options(monkeypatch, tmp_path,
                                                               random_model_dir) -> None:
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=FakeSGLang))
    engine, tokenizer = build_engine(ModelConfig(path=str(random_model_dir), dtype="float32"),
                                     sglang_placement(tmp_path), seed=9, max_num_seqs=4,
                                     max_len=64)
    assert isinstance(engine, SGLangEngine) and engine.eos_ids == [tokenizer.eos_token_id]
    kwargs = engine.engine.kwargs
    assert (kwargs["model_path"], kwargs["dtype"], kwargs["random_seed"]) == (
        str(random_model_dir), "float32", 9)
    assert (kwargs["device"], kwargs["base_gpu_id"], kwargs["tp_size"]) == ("cuda", 2, 2)
    assert kwargs["mem_fraction_static"] == 0.6 and kwargs["context_length"] == 64
    assert kwargs["max_running_requests"] == 4
    assert kwargs["enable_deterministic_inference"] is True
    shapes, tied = parameter_shapes(str(random_model_dir), trust_remote_code=False)
    assert tied
    tensors = {name: torch.zeros(shape) for name, shape in shapes.items()}
    assert engine.device == "cuda:2"
    engine.device = "meta"  # stands in for cuda:2, which this machine lacks
    engine.load_weights(1, tensors)
    sent = [pair for update in engine.engine.updates for pair in update["named_tensors"]]
    assert sorted(name for name, _ in sent) == sorted([*shapes, "lm_head.weight"])
    assert {tensor.device.type for _, tensor in sent} == {"meta"}
