"""A run's memory plan, one GPU of each process, and the launch's warning when one does not
fit its GPU.

The learner and the generators plan their own sides (``relay.learner.memory_plan``,
``relay.generators.memory_plan``); they never import each other, so they meet here, where the
policy's parameters are counted once (on the ``meta`` device) for both. ``plan_run`` plans
a learner rank and every generator (and the evaluator when the run evaluates) placed
on a GPU; ``memory_warnings`` judges those on this machine's GPUs against their memory
(``nvidia-smi``) before anything starts: a warning, never a refusal (the plan is an
estimate). ``tools/plan-memory.py`` prints the same plans for any GPU size.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch
from transformers import AutoConfig, PretrainedConfig

from relay.configs.gpu_placement import on_cuda
from relay.configs.run_schema import RunConfig
from relay.configs.topology_schema import EnginePlacement, Topology
from relay.generators.memory_plan import CUDA_CONTEXT_BYTES, OWN_POOL_ENGINES, plan_engine
from relay.learner.memory_plan import (
    GIB,
    HELD,
    MemoryItem,
    MemoryPlan,
    count_learner_models,
    plan_learner,
)
from relay.transport.endpoints import is_loopback

ConfigOf = Callable[[str], PretrainedConfig]
GpuBytes = Callable[[str, str, list[int] | None], int | None]  # (host, device, gpus) -> bytes


class ProcessMemory(msgspec.Struct, frozen=True, kw_only=True):
    """A process's plan on one of its GPUs, against that GPU's memory."""

    plan: MemoryPlan
    gpu_bytes: int

    @property
    def fits(self) -> bool:
        return self.plan.peak <= self.gpu_bytes and not self.plan.problems


def plan_run(run: RunConfig, topology: Topology, *, config_of: ConfigOf,
             gpu_bytes: GpuBytes) -> list[ProcessMemory]:
    """The plan of every process of ``topology`` that runs on a GPU whose memory
    ``gpu_bytes(host, device, gpus)`` knows (None: not on a GPU, or not known here): a
    learner rank (of ``len(hosts) x nproc_per_node``), each generator, and the evaluator
    when ``run`` evaluates."""
    learner = topology.learner
    engines: list[tuple[str, EnginePlacement]] = [
        (f"generator {g.name}", g) for g in topology.generators]
    if run.evaluates:
        engines.append(("evaluator", topology.evaluator))
    planned: list[ProcessMemory] = []
    learner_gpu = gpu_bytes(learner.hosts[0], learner.device, learner.gpus)
    models = count_learner_models(run, config_of)
    if learner_gpu is not None:
        ranks = len(learner.hosts) * learner.nproc_per_node
        planned.append(ProcessMemory(plan=plan_learner(run, models, ranks),
                                     gpu_bytes=learner_gpu))
    for name, placement in engines:
        size = gpu_bytes(placement.host, placement.device, placement.gpus)
        if size is not None:
            planned.append(ProcessMemory(gpu_bytes=size, plan=plan_generator(
                name, placement, run, config_of(run.model.path), models.policy.numel, size)))
    return planned


class EngineSizing(msgspec.Struct, frozen=True, kw_only=True):
    """What sizes an engine's memory, read from its topology section."""

    utilization: float
    tensor_parallel: int = 1
    max_num_batched_tokens: int
    max_model_len: int = 0  # 0: the run's prompt + response length


def engine_sizing(placement: EnginePlacement) -> EngineSizing:
    """vLLM's or SGLang's section for those engines; the ``lean`` section for Relay's (the
    torch and hf engines' caches grow to every sequence at full length whatever it says)."""
    if placement.engine in OWN_POOL_ENGINES:
        options = getattr(placement, placement.engine)
        return EngineSizing(utilization=options.gpu_memory_utilization,
                            tensor_parallel=options.tensor_model_parallel_size,
                            max_num_batched_tokens=options.max_num_batched_tokens,
                            max_model_len=options.max_model_len)
    return EngineSizing(utilization=placement.lean.gpu_memory_utilization,
                        max_num_batched_tokens=placement.lean.max_num_batched_tokens)


def plan_generator(name: str, placement: EnginePlacement,
                   run: RunConfig, config: PretrainedConfig, numel: int,
                   gpu_bytes: int) -> MemoryPlan:
    """The first GPU of a generator (or the evaluator): ``relay.generators.memory_plan``'s parts
    as items, every one held from the engine's start."""
    engine, sizing = placement.engine, engine_sizing(placement)
    parallel = sizing.tensor_parallel
    max_len = sizing.max_model_len or run.data.max_prompt_length + run.rollout.response_length
    memory = plan_engine(config, engine=engine, numel=numel, dtype=getattr(torch, run.model.dtype),
                         max_num_seqs=run.rollout.max_num_seqs, max_len=max_len,
                         gpu_bytes=gpu_bytes, utilization=sizing.utilization,
                         tensor_parallel=parallel,
                         max_num_batched_tokens=sizing.max_num_batched_tokens)
    share = f" / {parallel} GPUs" if parallel > 1 else ""
    items = [MemoryItem(name="CUDA context", bytes=CUDA_CONTEXT_BYTES, formula="an allowance"),
             MemoryItem(name="weights", bytes=memory.weights,
                        formula=f"{numel:,} x {run.model.dtype}{share}"),
             MemoryItem(name="next version (device copy)", bytes=memory.next_version,
                        formula="the weights again" if memory.next_version else "on the host"),
             MemoryItem(name="KV cache", bytes=memory.kv_cache,
                        formula=f"{memory.cache_positions:,} positions"),
             MemoryItem(name="step workspace", bytes=memory.workspace, formula="a bound")]
    full = memory.cache_positions // max_len
    notes = [f"{engine} engine, gpu_memory_utilization {sizing.utilization:g}: the KV cache "
             f"holds {memory.cache_positions:,} positions, {full:,} of the "
             f"{run.rollout.max_num_seqs} sequences (rollout.max_num_seqs) at full length "
             f"({max_len:,})"]
    return MemoryPlan(process=f"{name} ({engine}{share})", items=items, notes=notes,
                      problems=[memory.problem] if memory.problem else [],
                      advice="a smaller gpu_memory_utilization (Relay's engines assemble the "
                             "next version outside it), rollout.max_num_seqs or response "
                             "length, or (vllm, sglang) tensor_model_parallel_size over more "
                             "GPUs lowers it")


def local_gpu_memory() -> list[int]:
    """Total memory of each GPU of this machine, by index (``nvidia-smi``); [] when there is
    none or no ``nvidia-smi`` (the launcher never initialises CUDA itself)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(float(line)) << 20 for line in out.split() if line.strip()]  # MiB


def local_gpu_bytes(memory: list[int]) -> GpuBytes:
    """``plan_run``'s ``gpu_bytes`` for this machine's GPUs ``memory``: for a process on
    CUDA on this machine, the smallest of its GPUs (those it lists, the one its ``device``
    names, else any); None for a process elsewhere or on the CPU."""
    def size(host: str, device: str, gpus: list[int] | None) -> int | None:
        if not memory or not is_loopback(host) or not on_cuda(device):
            return None
        index = device.partition(":")[2]
        picked = gpus if gpus is not None else [int(index)] if index else range(len(memory))
        sizes = [memory[i] for i in picked if i < len(memory)]
        return min(sizes) if sizes else None
    return size


def memory_warnings(run: RunConfig, topology: Topology, run_file: str,
                    memory: list[int] | None = None) -> list[str]:
    """A line for each process on this machine's GPUs whose plan does not fit its GPU
    (``memory``: each GPU's bytes, default ``local_gpu_memory()``), naming what lowers it
    and the command that prints the plan (``run_file``: the run config); none for a run on
    the CPU, nor for a model without a config.json here (a ``builtin:`` one is built
    later)."""
    memory = local_gpu_memory() if memory is None else memory
    if not memory or not all((Path(p) / "config.json").is_file()
                             for p in run.learner_model_paths):
        return []
    trust = run.model.trust_remote_code
    planned = plan_run(run, topology, gpu_bytes=local_gpu_bytes(memory),
                       config_of=lambda p: AutoConfig.from_pretrained(p, trust_remote_code=trust))
    ranks = len(topology.learner.hosts) * topology.learner.nproc_per_node
    return [f"{p.plan.process} may not fit its {p.gpu_bytes / GIB:.1f} GiB GPU: "
            + ("; ".join(p.plan.problems) if p.plan.problems else
               f"its plan peaks at {p.plan.peak / GIB:.1f} GiB ({p.plan.peak_phase}); "
               + p.plan.advice)
            + f". The plan item by item: tools/plan-memory.py {run.model.path} --run "
              f"{run_file} --ranks {ranks} --gpu-gib {p.gpu_bytes / GIB:g}"
            for p in planned if not p.fits]


def format_plans(planned: list[ProcessMemory]) -> str:
    """The plans as a table a person reads: GiB per item and the phases it is held in, then
    the peak against the GPU."""
    lines: list[str] = []
    for p in planned:
        plan = p.plan
        lines += [plan.process, f"  {'item':<34} {'GiB':>7}  {'held':<42}  how"]
        for item in plan.items:
            held = "always" if item.phases == (HELD,) else ", ".join(item.phases)
            lines.append(f"  {item.name:<34} {item.bytes / GIB:>7.2f}  {held:<42}  "
                         f"{item.formula}".rstrip())
        totals = plan.phase_bytes()
        phases = ", ".join(f"{name} {size / GIB:.2f}" for name, size in totals.items()
                           if name != HELD)
        lines.append(f"  held always {totals[HELD] / GIB:.2f} GiB; on top, one at a time: "
                     f"{phases or 'nothing'}")
        verdict = "fits" if p.fits else "DOES NOT FIT"
        lines.append(f"  peak {plan.peak / GIB:.2f} GiB ({plan.peak_phase}) of "
                     f"{p.gpu_bytes / GIB:.2f} GiB: {verdict}")
        lines += [f"  note: {note}" for note in plan.notes]
        lines += [f"  problem: {problem}" for problem in plan.problems]
        lines.append("")
    return "\n".join(lines)


def plans_json(planned: list[ProcessMemory]) -> bytes:
    """The plans, machine-readable: per process its items (bytes, phases, formula), the
    bytes of each phase, the peak, the GPU's bytes and whether it fits."""
    return msgspec.json.encode([
        {"process": p.plan.process, "gpu_bytes": p.gpu_bytes, "peak_bytes": p.plan.peak,
         "peak_phase": p.plan.peak_phase, "fits": p.fits,
         "phase_bytes": p.plan.phase_bytes(), "items": p.plan.items, "notes": p.plan.notes,
         "problems": p.plan.problems} for p in planned])
