"""Check B: a weight version from the learner on the device to an engine on the device.

In one worker process on the device, per dtype (fp32, bf16):

- publish: the learner takes a step (version 1) and publishes it as ``TrainLoop`` does
  (``relay.learner.weights.publish_weights`` on its ``WeightStream``) to a ``WeightReceiver`` in
  the same process; what arrives must equal, bit for bit, the learner's weights in the
  publish dtype. The stream's GB/s is measured.
- engines (the lean engine; vLLM when its CUDA build is installed): the engine holds
  version 0 (the checkpoint) and generates ``ENGINE_GROUPS`` groups through ``SLOTS``
  slots; after ``SWAP_AT`` decode steps the between-steps hook loads the published version
  1, so the groups in flight go on under version 1 and the later ones start under it.
  Every token carries the version that sampled it; the versions must rise 0 then 1, with
  sequences that cross the swap and sequences begun after it. A token whose whole context
  was computed by its own version (every token of a sequence that started after the swap;
  a sequence's tokens before it) must carry the learner's log-prob under that version
  (version 0: the frozen reference, which is the initial policy; version 1: the trained
  policy) within ``LOGPROB_TOL`` on average. Tokens sampled after the swap in a sequence
  begun before it attend to keys and values version 0 computed (in-flight updates keep the
  cache); their error is reported, not bounded. ``LR`` is large enough that the two
  versions' log-probs differ by more than the bound (``version_gap``): an engine that
  ignored the new weights would fail.
- reward-model (beside the lean engine's records): a discriminative reward model scores on
  the device as on the CPU (``gpucheck.reward_check``).
"""

from __future__ import annotations

import gc
import importlib.metadata as metadata
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gpucheck.report import CheckResult
from gpucheck.reward_check import reward_model_check

if TYPE_CHECKING:
    from gpucheck.cli import Worker, WorkerRunner

LR = 1e-2  # the step to version 1 (weights move about lr: module docstring)
LOGPROB_TOL = {"float32": 1e-3, "bfloat16": 3e-2}  # mean |engine - learner| per token
ENGINE_GROUPS, ENGINE_SAMPLES, SLOTS, NEW_TOKENS, SWAP_AT = 6, 2, 4, 10, 4
BUCKET_BYTES = 256 << 10  # a few buckets for the small model
ARRIVAL_TIMEOUT_S = 60.0


def vllm_cuda_build() -> str | None:
    """Why vLLM's check cannot run here (no vLLM, or its CPU build), or None."""
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return "vLLM is not installed (on a GPU machine: `pip install vllm`)"
    if version.endswith("+cpu"):
        return f"vLLM {version} is a CPU build"
    return None


# -- in the worker process --------------------------------------------------------------

def weights_worker(model_dir: Path, device_setting: str, dtypes: list[str]) -> dict:
    """``{"results": [CheckResult fields...]}``: the publish and the lean engine, per dtype."""
    return _worker(model_dir, device_setting, dtypes, "lean")


def vllm_worker(model_dir: Path, device_setting: str, dtypes: list[str]) -> dict:
    """As ``weights_worker``, vLLM's records only, and one dtype a process: vLLM's engine
    holds ``gpu_memory_utilization`` of the GPU until it shuts down, and its shutdown
    destroys the process's default group (``cleanup_dist_env_and_memory``)."""
    (dtype,) = dtypes
    outcome = _worker(model_dir, device_setting, [dtype], "vllm")
    outcome["results"] = [r for r in outcome["results"] if r["name"].startswith("B/vllm")]
    return outcome


def _worker(model_dir: Path, device_setting: str, dtypes: list[str], engine: str) -> dict:
    from relay.learner.model import learner_device

    from gpucheck.build import init_one_rank_group

    device = learner_device(device_setting, 0)
    init_one_rank_group(device)
    results: list[CheckResult] = []
    for dtype in dtypes:
        began = time.monotonic()
        try:
            results += _version_to_engine(model_dir, device, dtype, engine)
        except Exception:  # noqa: BLE001 - reported; the other dtype goes on
            results.append(CheckResult.failure(f"B/{engine}:{dtype}",
                                               traceback.format_exc(limit=-6)))
        if engine == "lean":  # once per dtype, beside the lean engine's records
            try:
                results.append(reward_model_check(model_dir, device, dtype))
            except Exception:  # noqa: BLE001 - reported; the other dtype goes on
                results.append(CheckResult.failure(f"B/reward-model:{dtype}",
                                                   traceback.format_exc(limit=-6)))
        gc.collect()
        print(f"{device} {engine} {dtype} done in {time.monotonic() - began:.1f} s",
              flush=True)
    return {"results": [vars(r) for r in results]}


def _version_to_engine(model_dir: Path, device: torch.device, dtype: str,
                       engine: str) -> list[CheckResult]:
    """The learner's step to version 1, its publish, and ``engine``'s swap to it."""
    from gpucheck.build import check_learner, host_batch, synthetic_groups

    learner = check_learner(model_dir, device, dtype, ["actor.use_kl_loss=true"], lr=LR)
    learner.step(host_batch(synthetic_groups(learner.model.config.vocab_size), device))
    publish, staged = _publish(learner, getattr(torch, dtype), f"B/publish:{dtype}")
    if staged is None:
        return [publish, CheckResult.failure(f"B/{engine}:{dtype}", "version 1 never arrived")]
    return [publish, swap_in_flight(engine, learner, staged, model_dir, device, dtype)]


def _publish(learner, dtype: torch.dtype, name: str
             ) -> tuple[CheckResult, dict[str, torch.Tensor] | None]:
    """Publish the learner's policy as version 1 to a receiver in this process, which
    assembles it as a generator of an engine on the learner's device would (on a GPU in a
    device copy: ``relay.generators.weight_receiver.DeviceCopy``); the record and (a copy of) the
    tensors received."""
    from relay.generators.engine import copy_device
    from relay.generators.weight_receiver import WeightReceiver
    from relay.learner.weight_buckets import plan_buckets
    from relay.learner.weights import WeightServer, WeightStream, publish_weights

    from gpucheck.build import cpu_copy

    plan = plan_buckets(learner.model, dtype, BUCKET_BYTES)
    server = WeightServer("tcp://127.0.0.1:*").start()
    stream = WeightStream("tcp://127.0.0.1:*")
    staging = copy_device(learner.device)
    receiver = WeightReceiver(server.endpoint, stream.endpoint, "gpu-check", poll_s=0.05,
                              staging_device=staging).start(applied_version=0)
    try:
        deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
        while not receiver.wait_subscribed(timeout_s=0.05):
            if time.monotonic() > deadline:
                return CheckResult.failure(name, "the receiver never heard the stream"), None
            stream.beacon()
        staged, stats = None, []
        while staged is None and time.monotonic() < deadline:
            server.take_resend()
            stats.append(publish_weights(learner.model, plan, dtype, version=1, step=1,
                                         stream=stream))
            server.published(1, 1)
            with receiver.handover(at_least=1, wait_s=5.0) as version:
                if version is not None:  # the device copy is refilled once this block ends
                    staged = {n: t.clone() for n, t in version.tensors.items()}
    finally:
        receiver.stop()
        stream.close()
        server.stop()
    if staged is None:
        return CheckResult.failure(name, f"version 1 did not arrive in {len(stats)} "
                                         "publishes"), None
    expected = {n: cpu_copy(p, dtype) for n, p in learner.model.named_parameters()}
    different = sorted(n for n, t in expected.items()
                       if n not in staged or not torch.equal(staged[n].cpu(), t))
    first = stats[0]
    numbers = {"bytes": first.total_bytes, "seconds": round(first.seconds, 4),
               "gb_per_s": first.total_bytes / max(first.seconds, 1e-9) / 1e9,
               "publishes": len(stats), "buckets": len(plan.buckets)}
    error = f"{len(different)} tensors differ, e.g. {different[:3]}" if different else None
    assembled = f"assembled in a device copy on {staging}" if staging else "assembled on the host"
    return CheckResult(name=name, passed=not different, numbers=numbers, error=error,
                       notes=[assembled]), staged


def swap_in_flight(engine_name: str, learner, tensors: dict[str, torch.Tensor],
                    model_dir: Path, device: torch.device, dtype: str) -> CheckResult:
    """The engine generates under version 0, loads version 1 after ``SWAP_AT`` decode steps,
    goes on; its behavior log-probs against the learner's (module docstring)."""
    from relay.generators.engine import GroupRequest
    from relay.generators.sampling import SamplingParams

    from gpucheck.build import check_engine, synthetic_groups

    name = f"B/{engine_name}:{dtype}"
    engine = check_engine(engine_name, model_dir, device, dtype, slots=SLOTS, max_len=64)
    prompts = [g.samples[0].prompt_ids.tolist()
               for g in synthetic_groups(learner.model.config.vocab_size, seed=1)]
    prompts = (prompts * ENGINE_GROUPS)[:ENGINE_GROUPS]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)
    for key, prompt in enumerate(prompts):
        engine.submit(GroupRequest(key, prompt, ENGINE_SAMPLES, params))
    swap = _SwapAfter(SWAP_AT, lambda: engine.load_weights(1, tensors))
    finished = {}
    while engine.in_flight:
        for group in engine.step(swap):
            finished[group.key] = group.completions
    return _against_learner(name, learner, prompts, finished, device, LOGPROB_TOL[dtype])


class _SwapAfter:
    """A between-steps hook that calls ``swap`` the ``at``-th time it is called."""

    def __init__(self, at: int, swap: Callable[[], None]) -> None:
        self.at, self.swap, self.calls = at, swap, 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == self.at:
            self.swap()


def _against_learner(name: str, learner, prompts: list[list[int]], finished: dict,
                     device: torch.device, tolerance: float) -> CheckResult:
    from relay.learner.model import forward_logprobs
    from relay.transport.messages import RolloutGroup, Sample

    from gpucheck.build import TEMPERATURE, host_batch

    groups = [RolloutGroup(rollout_id=str(key), lease_id="b", prompt_id=str(key),
                           generator_id="gpu-check",
                           samples=[Sample(prompt_ids=torch.tensor(prompts[key],
                                                                   dtype=torch.int32),
                                           response_ids=c.token_ids, logprobs=c.logprobs,
                                           versions=c.versions, reward=0.0)
                                    for c in completions])
              for key, completions in sorted(finished.items())]
    batch = host_batch(groups, device)
    with torch.no_grad():
        by_version = [forward_logprobs(model, batch.to(device), TEMPERATURE, False,
                                       learner.micro.share_prompts)[0].float().cpu()
                      for model in (learner.reference, learner.model)]
    mask = batch.response_mask > 0
    versions = batch.versions
    first = versions.gather(1, mask.float().argmax(1, keepdim=True))  # each row's first token
    learner_logprobs = torch.where(versions == 1, by_version[1], by_version[0])
    error = (batch.behavior_logprobs - learner_logprobs).abs()
    clean = mask & (versions == first)
    crossing = mask & (versions == 1) & (first == 0)
    began_after = mask & (first == 1)
    numbers = {
        "logprob_err": _mean(error, clean),
        "v0_err": _mean(error, clean & (versions == 0)),
        "v1_err": _mean(error, began_after),
        "in_flight_err": _mean(error, crossing),
        "version_gap": _mean((by_version[1] - by_version[0]).abs(), began_after),
        "tokens_v0": int((mask & (versions == 0)).sum()), "tokens_v1": int(began_after.sum()),
        "tokens_in_flight": int(crossing.sum())}
    problems = []
    rising = bool(((versions[:, 1:] >= versions[:, :-1]) | ~mask[:, 1:]).all())
    if not rising or not set(versions[mask].tolist()) <= {0, 1}:
        problems.append("token versions do not rise 0 then 1 within a response")
    for key in ("tokens_v0", "tokens_v1", "tokens_in_flight"):
        if not numbers[key]:
            problems.append(f"no {key.removeprefix('tokens_')} tokens: the swap was not mid-run")
    if not numbers["logprob_err"] < tolerance:
        problems.append(f"logprob_err {numbers['logprob_err']:.3g} is not below {tolerance:g}")
    if not numbers["version_gap"] > tolerance:
        problems.append(f"versions 0 and 1 differ by only {numbers['version_gap']:.3g}: the "
                        "check cannot tell them apart")
    return CheckResult(name=name, passed=not problems, numbers=numbers,
                       error="; ".join(problems) or None)


def _mean(values: torch.Tensor, where: torch.Tensor) -> float:
    return float(values[where].double().mean()) if bool(where.any()) else float("nan")


# -- in the parent ----------------------------------------------------------------------

def weights_checks(workers: WorkerRunner, device: str) -> list[CheckResult]:
    """Run the device's workers: the lean engine's, then vLLM's (one a dtype), or vLLM's
    skip where it cannot run."""
    results = _records(workers.start("weights", device))
    why_not = "the check runs on a GPU" if device != "cuda" else vllm_cuda_build()
    if why_not:
        return results + [CheckResult.skip("B/vllm", why_not)]
    for dtype in workers.dtypes:
        results += _records(workers.start("vllm", device, dtypes=(dtype,)))
    return results


def _records(worker: Worker) -> list[CheckResult]:
    return [CheckResult(**fields) for fields in worker.result()["results"]]
