"""Check A: a learner step on the device, in fp32 and bf16, against the same step on the CPU.

Each scenario (``SCENARIOS``) builds the learner ``relay.learner.main`` builds for the embedded
default run config with the scenario's keys, on a random Qwen2, one rank (NCCL on a GPU,
gloo on the CPU), and takes one step on the same synthetic batch. A worker process on the
device runs every scenario in fp32 (TF32 off, SDPA's math kernel) and in bf16, and another,
which sees no GPU, in fp32 on the CPU: the reference. Then, per scenario:

- fp32 on the device against the CPU: log-probs and entropies of the batch before the step
  within ``LOGPROB_TOL``, the loss within ``LOSS_TOL``, the updated weights within
  ``WEIGHT_TOL``, the gradients (Adam's first moments, ``(1 - beta1) g``) within
  ``GRAD_REL_TOL`` of their largest;
- bf16 on the device: everything finite, log-probs and loss within ``BF16_TOL`` of fp32;
- every parameter, gradient and optimizer state (not Adam's step count, which torch keeps on
  the CPU) of every model the learner trains or holds on the device, or on the CPU where
  ``actor.fsdp_config`` offloads it;
- measured: peak device memory of the step and host syncs from ``learner/`` and
  ``algorithms/`` during it (``tests/device_audit.DeviceAudit``).

The learning rate is ``LR``: Adam's first step moves each weight by ``lr g / (|g| + eps)``,
about ``lr`` whatever the gradient's size, so where float rounding flips the sign of a
near-zero gradient the weights differ by up to ``2 lr``; at 4e-6 that stays under the 1e-5
bar, which then measures the arithmetic, and the gradients are compared on their own.
"""

from __future__ import annotations

import gc
import importlib.util
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from gpucheck.report import CheckResult, bounded

if TYPE_CHECKING:
    from gpucheck.cli import WorkerRunner

LR = 4e-6
LOGPROB_TOL = 1e-4
LOSS_TOL = 1e-4
WEIGHT_TOL = 1e-5
GRAD_REL_TOL = 1e-3
BF16_TOL = 5e-2


@dataclass(frozen=True)
class Scenario:
    """A learner configuration: run-config ``overrides``; ``ulysses``: a Ulysses group of
    one; ``offloaded``: the policy's and reference's parameters, gradients and optimizer
    state live on the CPU; ``needs``: the module of an optional extra it runs on (skipped,
    saying so, where that is not installed)."""

    name: str
    overrides: tuple[str, ...]
    ulysses: bool = False
    offloaded: bool = False
    needs: str = ""


SCENARIOS = (
    Scenario("grpo", ("algorithm.adv_estimator=grpo", "actor.share_prompts=true",
                      "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=64",
                      "actor.use_kl_loss=true")),
    Scenario("gae", ("algorithm.adv_estimator=gae",)),
    Scenario("prime", ("algorithm.adv_estimator=prime",)),
    Scenario("offload", ("actor.fsdp_config.param_offload=true",
                         "actor.fsdp_config.optimizer_offload=true", "actor.use_kl_loss=true"),
             offloaded=True),
    Scenario("ulysses", ("actor.use_kl_loss=true",), ulysses=True),
    Scenario("lora", ("model.lora_rank=8", "model.lora_alpha=16", "actor.use_kl_loss=true")),
    Scenario("deepspeed", ("actor.strategy=deepspeed", "actor.deepspeed.zero_stage=2",
                           "actor.use_kl_loss=true"), needs="deepspeed"),
)


# -- in the worker process --------------------------------------------------------------

def learner_worker(model_dir: Path, device_setting: str, dtypes: list[str]) -> dict:
    """``{"scenario:dtype": outcome}`` of every scenario on this process's device; an
    outcome is ``{"error": traceback}`` when its step failed."""
    from relay.learner.model import learner_device

    from gpucheck.build import init_one_rank_group

    device = learner_device(device_setting, 0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    init_one_rank_group(device)
    outcomes = {}
    for scenario in SCENARIOS:
        if scenario.needs and importlib.util.find_spec(scenario.needs) is None:
            for dtype in dtypes:
                outcomes[f"{scenario.name}:{dtype}"] = {
                    "skipped": f"{scenario.needs} is not installed on {device.type}"}
            continue
        for dtype in dtypes:
            began = time.monotonic()
            try:
                outcomes[f"{scenario.name}:{dtype}"] = _step(scenario, model_dir, device, dtype)
                verdict = "done"
            except Exception as error:  # noqa: BLE001 - reported; the others go on
                outcomes[f"{scenario.name}:{dtype}"] = {"error": traceback.format_exc(limit=-6)}
                verdict = f"FAILED ({type(error).__name__}: {error})"
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"{device} {scenario.name}:{dtype} {verdict} in "
                  f"{time.monotonic() - began:.1f} s", flush=True)
    return outcomes


@contextmanager
def _exact(device: torch.device, dtype: str) -> Iterator[None]:
    """fp32 on a GPU as on the CPU: SDPA's math kernel (TF32 is off for the whole worker)."""
    if device.type != "cuda" or dtype != "float32":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


def _step(scenario: Scenario, model_dir: Path, device: torch.device, dtype: str) -> dict:
    from relay.learner.model import forward_logprobs

    from gpucheck.build import TEMPERATURE, check_learner, cpu_copy, host_batch, \
        synthetic_groups

    with _exact(device, dtype):
        learner = check_learner(model_dir, device, dtype, list(scenario.overrides), lr=LR,
                                ulysses=scenario.ulysses)
        batch = host_batch(synthetic_groups(learner.model.config.vocab_size), device)
        before = {n: cpu_copy(p) for n, p in learner.model.named_parameters()}
        with torch.no_grad():
            logprobs, entropy = forward_logprobs(learner.model, batch.to(device), TEMPERATURE,
                                                 True, learner.micro.share_prompts, learner.sp)
        gradients = _GradientPlaces(learner, scenario, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with _device_audit()(["learner", "algorithms"]) as audit:
            metrics = learner.step(batch).metrics
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    after = {n: cpu_copy(p) for n, p in learner.model.named_parameters()}
    moments = _first_moments(learner)
    return {"logprobs": logprobs.float().cpu(), "entropy": entropy.float().cpu(),
            "mask": batch.response_mask, "weights": after, "moments": moments,
            "moved": max(float((after[n] - before[n]).abs().max()) for n in after),
            "metrics": metrics, "misplaced": gradients.misplaced + _misplaced(learner, scenario,
                                                                               device),
            "gradients": gradients.seen, "syncs": audit.sync_count,
            "sync_sites": [f"{n} x {site}" for site, n in audit.syncs.most_common(5)],
            "peak_gib": peak}


def _first_moments(learner) -> dict[str, torch.Tensor]:
    """Adam's first moments by parameter name, whole on the CPU: from the optimizer's
    state (FSDP2; a LoRA policy's adapters alone), or gathered from ZeRO's partitions
    (``actor.strategy = "deepspeed"``, ``deepspeed.utils.safe_get_full_optimizer_state``)."""
    from gpucheck.build import cpu_copy

    named = list(learner.model.named_parameters())
    if getattr(learner, "zero", None) is None:
        return {n: cpu_copy(learner.optimizer.state[p]["exp_avg"])
                for n, p in named if p in learner.optimizer.state}
    from deepspeed.utils import safe_get_full_optimizer_state

    moments = {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in named
               if p.requires_grad}
    return {n: cpu_copy(m) for n, m in moments.items() if m is not None}


def _device_audit() -> type:
    """``tests/device_audit.py``'s ``DeviceAudit``, loaded from its file: ``tests`` is no
    installed package, and a site-packages folder of that name (some wheels ship one)
    would hide this repository's."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "tests" / "device_audit.py"
    spec = importlib.util.spec_from_file_location("relay_device_audit", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DeviceAudit


def _parts(learner, scenario: Scenario, device: torch.device
           ) -> list[tuple[str, nn.Module, torch.optim.Optimizer | None, torch.device]]:
    """Every model the learner holds: its name, its optimizer (None when frozen), and the
    device its parameters, gradients and optimizer state belong on."""
    home = torch.device("cpu") if scenario.offloaded else device
    parts = [("actor", learner.model, learner.optimizer, home)]
    if learner.reference is not None:
        parts.append(("reference", learner.reference, None, home))
    if learner.critic is not None:
        parts.append(("critic", learner.critic.model, learner.critic.optimizer, device))
    if learner.prm is not None:
        parts.append(("prm", learner.prm.model, learner.prm.optimizer, device))
        if learner.prm.reference is not learner.reference:
            parts.append(("prm reference", learner.prm.reference, None, device))
    return parts


def _misplaced(learner, scenario: Scenario, device: torch.device) -> list[str]:
    """Parameters and optimizer states away from their device (``_parts``)."""
    from gpucheck.build import local_device

    found = []
    for part, model, optimizer, home in _parts(learner, scenario, device):
        for name, param in model.named_parameters():
            if local_device(param) != home:
                found.append(f"{part} {name}: parameter on {local_device(param)}, not {home}")
            state = optimizer.state.get(param, {}) if optimizer is not None else {}
            for key, value in state.items():
                if torch.is_tensor(value) and key != "step" and local_device(value) != home:
                    found.append(f"{part} {name}: {key} on {local_device(value)}, not {home}")
    return found


class _GradientPlaces:
    """Where each gradient is when its optimizer steps (a step pre-hook on every
    optimizer of the learner): ``seen`` gradients, ``misplaced`` ones described."""

    def __init__(self, learner, scenario: Scenario, device: torch.device) -> None:
        from gpucheck.build import local_device

        self.seen = 0
        self.misplaced: list[str] = []
        for part, model, optimizer, home in _parts(learner, scenario, device):
            if optimizer is None:
                continue
            names = {id(p): n for n, p in model.named_parameters()}

            def check(opt, _args, _kwargs, part=part, names=names, home=home) -> None:
                for group in opt.param_groups:
                    for param in group["params"]:
                        if param.grad is None:
                            continue
                        self.seen += 1
                        where = local_device(param.grad)
                        if where != home:
                            self.misplaced.append(f"{part} {names[id(param)]}: gradient on "
                                                  f"{where}, not {home}")

            optimizer.register_step_pre_hook(check)


# -- in the parent ----------------------------------------------------------------------

def learner_checks(workers: WorkerRunner, device: str) -> list[CheckResult]:
    """Run the device's worker and, beside it, the CPU's; compare them scenario by
    scenario."""
    device_worker = workers.start("learner", device)
    cpu_worker = workers.start("learner", "cpu", hide_gpu=True, dtypes=("float32",))
    on_device, on_cpu = device_worker.result(), cpu_worker.result()
    results = []
    for s in SCENARIOS:
        runs = (on_cpu.get(f"{s.name}:float32"), on_device.get(f"{s.name}:float32"),
                on_device.get(f"{s.name}:bfloat16"))
        skipped = next((run["skipped"] for run in runs if run and "skipped" in run), None)
        results.append(CheckResult.skip(f"A/{s.name}", skipped) if skipped
                       else compare(s.name, *runs))
    return results


def compare(name: str, reference: dict | None, fp32: dict | None,
            bf16: dict | None) -> CheckResult:
    """Check A's verdict on one scenario (module docstring)."""
    check = f"A/{name}"
    runs = {"cpu reference": reference, "fp32": fp32, "bf16": bf16}
    for label, run in runs.items():
        if run is None or "error" in run:
            return CheckResult.failure(check, f"{label}: " + (run or {}).get("error", "no result"))
    mask = reference["mask"] > 0
    numbers: dict[str, float | int | None] = {
        "logprob_err": _max_error(fp32["logprobs"][mask], reference["logprobs"][mask]),
        "entropy_err": _max_error(fp32["entropy"][mask], reference["entropy"][mask]),
        "loss_err": _loss_error(fp32["metrics"], reference["metrics"]),
        "weight_err": max(_max_error(fp32["weights"][n], w)
                          for n, w in reference["weights"].items()),
        "grad_rel_err": max(_max_error(fp32["moments"][n], m) for n, m
                            in reference["moments"].items())
        / max(float(m.abs().max()) for m in reference["moments"].values()),
        "moved": fp32["moved"], "syncs": fp32["syncs"], "peak_gib": fp32["peak_gib"],
        "gradients": fp32["gradients"]}
    problems: list[str] = []
    for key, limit in (("logprob_err", LOGPROB_TOL), ("entropy_err", LOGPROB_TOL),
                       ("loss_err", LOSS_TOL), ("weight_err", WEIGHT_TOL),
                       ("grad_rel_err", GRAD_REL_TOL)):
        bounded(key, numbers[key], limit, problems)
    if not fp32["moved"] >= LR / 2:
        problems.append(f"the step moved no weight by {LR / 2:g} (at most {fp32['moved']:.3g})")
    if not fp32["gradients"]:
        problems.append("no optimizer saw a gradient")
    numbers.update(bf16_logprob_err=_max_error(bf16["logprobs"][mask], fp32["logprobs"][mask]),
                   bf16_loss_err=_loss_error(bf16["metrics"], fp32["metrics"]),
                   bf16_syncs=bf16["syncs"], bf16_peak_gib=bf16["peak_gib"])
    bounded("bf16_logprob_err", numbers["bf16_logprob_err"], BF16_TOL, problems)
    bounded("bf16_loss_err", numbers["bf16_loss_err"], BF16_TOL, problems)
    if not _finite(bf16):
        problems.append("bf16: a log-prob, weight or metric is not finite")
    misplaced = fp32["misplaced"] + bf16["misplaced"]
    numbers["misplaced"] = len(misplaced)
    if misplaced:
        problems.append(f"{len(misplaced)} misplaced, e.g. " + "; ".join(misplaced[:3]))
    return CheckResult(name=check, passed=not problems, numbers=numbers,
                       error="; ".join(problems) or None,
                       notes=[f"fp32 step's host syncs: {site}" for site in fp32["sync_sites"]])


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _loss_error(metrics: dict[str, float], reference: dict[str, float]) -> float:
    """The largest difference between the losses (``*loss``) both steps report."""
    losses = [key for key in reference if key.endswith("loss") and key in metrics]
    return max(abs(metrics[key] - reference[key]) for key in losses)


def _finite(run: dict) -> bool:
    tensors = [run["logprobs"][run["mask"] > 0], *run["weights"].values()]
    return (all(bool(torch.isfinite(t).all()) for t in tensors)
            and all(torch.isfinite(torch.tensor(v)) for v in run["metrics"].values()))
