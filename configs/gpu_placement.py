"""Which process of a topology owns which GPU of its host (the topology's ``gpus`` lists).

A process with ``gpus`` is started with ``CUDA_VISIBLE_DEVICES`` set to them
(``relay.launcher.plan``) and sees them as ``cuda:0..k-1``, so its ``device`` is plain ``"cuda"``.
The invariant checked here: on one host, no GPU is listed by two processes. Accounting is per
host and all or nothing: where one process lists its GPUs, every process there on CUDA must
(one without a list would take ``cuda:0..`` of the whole machine, unaccounted). A topology
that lists none keeps today's behaviour: nothing is checked or set.

Hosts are compared by name, with every loopback address the launcher's own machine; two
names of one machine (``node1`` and its address) are not recognised as one.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from relay.configs.loader import ConfigError
from relay.configs.topology_schema import EnginePlacement, Topology
from relay.transport.endpoints import is_loopback

OWN_PARALLEL_ENGINES = ("vllm", "sglang")  # spread over tensor_model_parallel_size GPUs
THIS_MACHINE = "this machine"  # how a loopback host is named in messages


def on_cuda(device: str) -> bool:
    """Whether a topology ``device`` may put the process on a GPU (``auto``: when one is
    there)."""
    return device.partition(":")[0] in ("cuda", "auto")


class GpuClaim(msgspec.Struct, kw_only=True, frozen=True):
    """The GPUs one process takes: ``process`` as the launcher names it, ``key`` the
    setting that places it, ``gpus`` None when it lists none."""

    process: str
    key: str
    host: str
    device: str
    gpus: list[int] | None

    @property
    def machine(self) -> str:
        return THIS_MACHINE if is_loopback(self.host) else self.host


def check_process_gpus(topology: Topology, source: str) -> None:
    """Each process's ``gpus`` fit its own settings (``check_gpu_list``,
    ``check_engine_gpus``) and the learner's: one GPU per rank. ``ConfigError`` naming the
    key."""
    learner = topology.learner
    if learner.gpus is not None:
        check_gpu_list(source, learner.gpus, learner.device, gpus_key="learner.gpus",
                       device_key="learner.device", devices=("cuda", "auto"))
        if len(learner.gpus) != learner.nproc_per_node:
            raise ConfigError(source, "learner.gpus",
                              f"lists {len(learner.gpus)} GPU(s) for learner.nproc_per_node = "
                              f"{learner.nproc_per_node} ranks per host: give one GPU per "
                              "local rank (rank i runs on gpus[i]; the same list on every "
                              "learner host)")
    for section, placement in _engine_placements(topology):
        check_engine_gpus(placement, source, gpus_key=f"{section}.gpus",
                          device_key=f"{section}.device")
    for i, server in enumerate(topology.reward_models):  # its engine is the run config's
        if server.gpus is not None:
            check_gpu_list(source, server.gpus, server.device,
                           gpus_key=f"reward_models[{i}].gpus",
                           device_key=f"reward_models[{i}].device")


def check_engine_gpus(placement: EnginePlacement, source: str, *, gpus_key: str,
                      device_key: str) -> None:
    """A generator's or the evaluator's ``gpus`` (when it lists them) fit its device and
    engine: one GPU for Relay's engines, at least ``tensor_model_parallel_size`` for vLLM
    and SGLang."""
    gpus = placement.gpus
    if gpus is None:
        return
    check_gpu_list(source, gpus, placement.device, gpus_key=gpus_key, device_key=device_key)
    engine = placement.engine
    if engine in OWN_PARALLEL_ENGINES:
        parallel = getattr(placement, engine).tensor_model_parallel_size
        if len(gpus) < parallel:
            raise ConfigError(source, gpus_key,
                              f"lists {len(gpus)} GPU(s), but the {engine} engine's "
                              f"tensor_model_parallel_size = {parallel} needs one per shard: "
                              "list that many")
    elif len(gpus) != 1:
        raise ConfigError(source, gpus_key,
                          f"lists {len(gpus)} GPUs, but the {engine!r} engine runs on one: "
                          "list one (tensor parallelism over several takes engine = 'vllm' "
                          "or 'sglang')")


def check_gpu_list(source: str, gpus: list[int], device: str, *, gpus_key: str,
                   device_key: str, devices: tuple[str, ...] = ("cuda",)) -> None:
    """A ``gpus`` list names each GPU once and goes with a plain CUDA ``device`` (one of
    ``devices``): the process sees only its GPUs, as ``cuda:0..k-1``."""
    if not gpus:
        raise ConfigError(source, gpus_key, "is empty: list the GPUs the process runs on, or "
                                            "drop it to leave CUDA_VISIBLE_DEVICES as it is")
    twice = sorted({g for g in gpus if gpus.count(g) > 1})
    if twice:
        raise ConfigError(source, gpus_key, f"lists GPU {twice[0]} more than once: {gpus}")
    if device == "cpu":
        raise ConfigError(source, gpus_key, f"lists GPUs {gpus}, but {device_key} is 'cpu': "
                                            f"set {device_key} to 'cuda' to run on them, or "
                                            f"drop {gpus_key}")
    if device.startswith("cuda:"):
        raise ConfigError(source, device_key,
                          f"{device!r} with {gpus_key} = {gpus}: the process sees only its "
                          f"GPUs, as cuda:0 to cuda:{len(gpus) - 1}; set {device_key} to "
                          f"'cuda' (it runs on GPU {gpus[0]}) and list the GPU you meant in "
                          f"{gpus_key}")
    if device not in devices:
        raise ConfigError(source, device_key,
                          f"{device!r} with {gpus_key}: gpus places the process on CUDA GPUs; "
                          f"set {device_key} to 'cuda'")


def _engine_placements(topology: Topology) -> list[tuple[str, EnginePlacement]]:
    return [*((f"generators[{i}]", g) for i, g in enumerate(topology.generators)),
            ("evaluator", topology.evaluator)]


def topology_claims(topology: Topology, evaluates: bool) -> list[GpuClaim]:
    """The GPUs each process the launcher starts takes (the evaluator only when the run
    ``evaluates``), named as ``relay.launcher.plan`` names the processes."""
    learner = topology.learner
    several = len(learner.hosts) > 1
    claims = [GpuClaim(process=f"learner@{host}" if several else "learner", key="learner.gpus",
                       host=host, device=learner.device, gpus=learner.gpus)
              for host in learner.hosts]
    claims += [GpuClaim(process=f"reward server {r.name}", key=f"reward_models[{i}].gpus",
                        host=r.host, device=r.device, gpus=r.gpus)
               for i, r in enumerate(topology.reward_models)]
    claims += [GpuClaim(process=f"generator {g.name}", key=f"generators[{i}].gpus",
                        host=g.host, device=g.device, gpus=g.gpus)
               for i, g in enumerate(topology.generators)]
    if evaluates:
        evaluator = topology.evaluator
        claims.append(GpuClaim(process="evaluator", key="evaluator.gpus", host=evaluator.host,
                               device=evaluator.device, gpus=evaluator.gpus))
    return claims


def check_gpu_placement(claims: Sequence[GpuClaim], source: str) -> None:
    """No GPU of a host is listed by two processes, and where any process on a host lists
    its GPUs, every process there on CUDA does (module docstring). ``ConfigError`` naming
    both processes and the GPU, against the later claim's key."""
    by_machine: dict[str, list[GpuClaim]] = {}
    for claim in claims:
        by_machine.setdefault(claim.machine, []).append(claim)
    for machine, here in by_machine.items():
        listing = [c for c in here if c.gpus is not None]
        if not listing:
            continue
        for claim in here:
            if claim.gpus is None and on_cuda(claim.device):
                raise ConfigError(source, claim.key,
                                  f"{claim.process} runs on {claim.device!r} on {machine} "
                                  f"without a gpus list, where {listing[0].process} lists "
                                  f"its GPUs ({listing[0].key} = {listing[0].gpus}): list "
                                  f"{claim.process}'s own GPUs in {claim.key}, so that no "
                                  "GPU is used twice")
        owner: dict[int, GpuClaim] = {}
        for claim in listing:
            for gpu in claim.gpus or ():
                first = owner.setdefault(gpu, claim)
                if first is not claim:
                    raise ConfigError(source, claim.key,
                                      f"GPU {gpu} of {machine} is listed by both "
                                      f"{first.process} ({first.key} = {first.gpus}) and "
                                      f"{claim.process} ({claim.key} = {claim.gpus}): a GPU "
                                      "belongs to one process; give each its own")
