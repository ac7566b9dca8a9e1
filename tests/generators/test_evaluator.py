"""relay.generators.evaluator: the evaluator's settings come from the run's sections."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from relay.configs.run_schema import DataConfig, RolloutConfig, TrainerConfig, ValKwargs
from relay.generators.evaluator import Evaluator
from relay.generators.sampling import SamplingParams

NOBODY_LISTENS = "tcp://127.0.0.1:9"  # the discard port: no learner answers there


def evaluator(rollout: RolloutConfig, data: DataConfig, trainer: TrainerConfig) -> Evaluator:
    return Evaluator(weights_endpoint=NOBODY_LISTENS, stream_endpoint=NOBODY_LISTENS,
                     engine=SimpleNamespace(version=0), tokenizer=None, scorer=None, rows=[],
                     rollout=rollout, data=data, trainer=trainer)


def test_sampling_length_and_dumps_come_from_the_rollout_data_and_trainer_sections(
        tmp_path: Path) -> None:
    rollout = RolloutConfig(response_length=32,
                            val_kwargs=ValKwargs(temperature=0.6, top_p=0.9, top_k=5, n=3))
    data = DataConfig(train_files=[], max_prompt_length=9, truncation="right")
    trainer = TrainerConfig(log_val_generations=4, validation_data_dir=str(tmp_path / "val"),
                            max_waiting_evals=5)
    held_out = evaluator(rollout, data, trainer)
    try:
        assert held_out.params == SamplingParams(max_new_tokens=32, temperature=0.6, top_p=0.9,
                                                 top_k=5)
        assert (held_out.n, held_out.max_prompt_length, held_out.truncation) == (3, 9, "right")
        assert (held_out.log_generations, held_out.dump_dir) == (4, tmp_path / "val")
        assert held_out.weights.max_waiting == 5
    finally:
        held_out._client.close()


def test_without_do_sample_it_decodes_greedily_keeps_the_prompts_end_and_dumps_nothing() -> None:
    """``val_kwargs.do_sample = false`` is greedy whatever the temperature; with
    ``data.truncation = "error"`` a longer prompt keeps its end, as "left" does; no
    ``trainer.validation_data_dir``, no dump."""
    rollout = RolloutConfig(val_kwargs=ValKwargs(temperature=0.6, do_sample=False))
    held_out = evaluator(rollout, DataConfig(train_files=[], truncation="error"), TrainerConfig())
    try:
        assert held_out.params.temperature == 0.0
        assert held_out.truncation == "left" and held_out.dump_dir is None
    finally:
        held_out._client.close()
