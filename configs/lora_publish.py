"""What a LoRA policy publishes: merged weights, or its adapters alone.

Every engine can take merged weights, W' = W + (alpha / r) B A under the base model's
names (``relay.learner.lora.MergedWeights``): a publish as large as the model. vLLM's LoRA
support can instead run the adapters over the base model it loaded at start, so a publish
is only A and B, (r, in) and (out, r) per adapted layer: about r (in + out) / (in out) of
the adapted weights (``relay.generators.vllm_lora``). One stream reaches every engine of a
run (its generators, and its evaluator when the run evaluates), so the learner publishes
adapters only when all of them take adapters: engine ``vllm`` with ``vllm.enable_lora``
(the default). The learner and each generator decide it from the same run config and
topology; a generator attached later reads them from the run directory.
"""

from __future__ import annotations

from relay.configs.run_schema import RunConfig
from relay.configs.topology_schema import EnginePlacement, Topology


def takes_adapters(placement: EnginePlacement) -> bool:
    """Whether the engine of ``placement`` takes a LoRA policy's adapters alone."""
    return placement.engine == "vllm" and placement.vllm.enable_lora


def publishes_adapters(run: RunConfig, topology: Topology) -> bool:
    """Whether a LoRA run (``model.lora_rank`` > 0) publishes its adapters alone (module
    docstring); False for a run without LoRA."""
    if run.model.lora_rank == 0:
        return False
    engines: list[EnginePlacement] = [*topology.generators]
    if run.evaluates:
        engines.append(topology.evaluator)
    return all(takes_adapters(placement) for placement in engines)


def publish_problem(run: RunConfig, topology: Topology, placement: EnginePlacement,
                    name: str) -> str:
    """Why the engine process ``name`` (``placement``) cannot take this run's versions, or
    "": a generator attached to a run that publishes adapters must take them (the run's
    topology fixed what the learner sends)."""
    if not publishes_adapters(run, topology) or takes_adapters(placement):
        return ""
    return (f"{name}: this run publishes its LoRA adapters alone (every engine of its "
            "topology is vLLM with vllm.enable_lora), which engine "
            f"\"{placement.engine}\" cannot take: attach it with engine \"vllm\", or start "
            "the run with [generators.vllm] enable_lora = false (merged weights for every "
            "engine)")
