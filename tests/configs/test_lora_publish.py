"""What a LoRA policy publishes (``relay.configs.lora_publish``): its adapters alone only when
every engine of the run (generators, and the evaluator when the run evaluates) is vLLM with
its LoRA support on; a generator attached to such a run must take adapters."""

from __future__ import annotations

from relay.configs.lora_publish import publish_problem, publishes_adapters
from relay.configs.run_schema import DataConfig, ModelConfig, RunConfig, TrainerConfig
from relay.configs.topology_schema import (EvaluatorPlacement, GeneratorPlacement, Topology,
                                           VLLMOptions)

VLLM = dict(engine="vllm")
NO_LORA_VLLM = dict(engine="vllm", vllm=VLLMOptions(enable_lora=False))


def run(lora_rank: int = 8, evaluates: bool = False) -> RunConfig:
    return RunConfig(model=ModelConfig(path="/m", lora_rank=lora_rank),
                     data=DataConfig(train_files=["t.jsonl"],
                                     val_files=["v.jsonl"] if evaluates else []),
                     trainer=TrainerConfig(test_freq=5))


def topology(*generators: dict, evaluator: dict | None = None) -> Topology:
    return Topology(generators=[GeneratorPlacement(name=f"g{i}", **g)  # type: ignore[arg-type]
                                for i, g in enumerate(generators)],
                    evaluator=EvaluatorPlacement(**(evaluator or {})))  # type: ignore[arg-type]


def test_adapters_go_alone_only_when_every_engine_takes_them() -> None:
    assert publishes_adapters(run(), topology(VLLM, VLLM))
    assert not publishes_adapters(run(lora_rank=0), topology(VLLM))
    assert not publishes_adapters(run(), topology(VLLM, {"engine": "lean"}))
    assert not publishes_adapters(run(), topology(VLLM, NO_LORA_VLLM))
    # the evaluator counts when the run evaluates
    assert publishes_adapters(run(), topology(VLLM, evaluator={"engine": "lean"}))
    assert not publishes_adapters(run(evaluates=True), topology(VLLM, evaluator={"engine": "lean"}))
    assert publishes_adapters(run(evaluates=True), topology(VLLM, evaluator=VLLM))


def test_an_attached_generator_that_cannot_take_adapters_is_refused_by_name() -> None:
    adapters_run = topology(VLLM)
    lean = GeneratorPlacement(name="extra", engine="lean")
    problem = publish_problem(run(), adapters_run, lean, "generator 'extra'")
    assert problem.startswith("generator 'extra': this run publishes its LoRA adapters alone")
    assert "enable_lora = false" in problem
    assert publish_problem(run(), adapters_run, GeneratorPlacement(name="x", **VLLM), "x") == ""
    assert publish_problem(run(), topology({"engine": "lean"}), lean, "x") == ""
