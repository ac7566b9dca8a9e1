"""The evaluator: ``python -m relay.generators.evaluator --run-dir RUN_DIR``.

Held-out evaluation as a job of its own, so that no learner step ever waits for it. The
launcher starts it when the run has validation data (``RunConfig.evaluates``), where the
topology's ``evaluator`` section says. At each evaluation step (step 0 with
``trainer.val_before_train``, every ``trainer.test_freq`` steps, the last step) the
learner's rank 0 offers its newest published version: the version went by on the weight
stream, which this process subscribes to like a generator, and an ``EvalOffer`` after it
tells this process to keep it (``relay.generators.weight_receiver.EvalWeights``). This process
asks for the next offer (``EvalRequest``; the first only once it has heard the stream: the
learner streams ``StreamBeacon``s until that first request and nothing else before it, so
no offered version goes by before this process listens), loads the kept
version into its own engine, decodes the validation prompts (``relay.generators.held_out``) and
hands the metrics back with its next request. The learner logs them against the step
whose weights they measured. When evaluation is slower than the offers come, they wait
(in the learner's queue, ``relay.learner.eval_queue``, and as copies here), the oldest skipped
past ``trainer.max_waiting_evals``. Weights that never arrived are reported as not
evaluated (empty metrics). The evaluator exits when the learner says the run is over.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from relay.algorithms.rewards.scorer import RewardScorer
from relay.configs.lora_publish import publishes_adapters
from relay.configs.prompt_data import (
    PromptRow,
    chat_token_counter,
    cut_side,
    fit_prompts,
    load_prompt_rows,
)
from relay.configs.run_schema import DataConfig, RolloutConfig, TrainerConfig
from relay.configs.rundir import configure_logging, load_run_dir
from relay.generators.build import build_engine
from relay.generators.engine import Engine
from relay.generators.held_out import eval_metrics, evaluate, write_generations
from relay.generators.sampling import SamplingParams
from relay.generators.tool_loop import ConfiguredWorkflow, configured_workflow
from relay.generators.weight_receiver import EvalWeights
from relay.generators.workflow import WorkflowRunner
from relay.transport.messages import ErrorReply, EvalReport, EvalRequest, Shutdown, WeightManifest
from relay.transport.security import ClientKeys
from relay.transport.sockets import Client, PeerTimeout

logger = logging.getLogger("relay.evaluator")

POLL_S = 0.5  # between requests while nothing new is offered
REQUEST_TIMEOUT_S = 10.0
ARRIVAL_WAIT_S = 60.0  # for offered weights still on their way (or asked for again)
SUBSCRIBE_WARN_S = 30.0  # says so each time this long goes by with the weight stream unheard


def val_sampling_params(rollout: RolloutConfig) -> SamplingParams:
    """The engine's sampling parameters for held-out evaluation (``rollout.val_kwargs``)."""
    val = rollout.val_kwargs
    return SamplingParams(max_new_tokens=rollout.response_length,
                          temperature=val.sampling_temperature, top_p=val.top_p, top_k=val.top_k)


class Evaluator:
    """Asks for weights to evaluate, evaluates them, reports, until the run is over.

    It reads the run's sections: ``rollout`` (``val_kwargs``: sampling and ``n``; the
    response length), ``data`` (the prompt length limit and how to cut a longer prompt) and
    ``trainer`` (``log_val_generations``, ``validation_data_dir``, ``max_waiting_evals``).
    """

    def __init__(self, *, weights_endpoint: str, stream_endpoint: str, engine: Engine,
                 tokenizer, scorer: RewardScorer, rows: list[PromptRow], rollout: RolloutConfig,
                 data: DataConfig, trainer: TrainerConfig,
                 keys: ClientKeys | None = None,
                 workflow: ConfiguredWorkflow | None = None) -> None:
        self.engine, self.tokenizer, self.scorer = engine, tokenizer, scorer
        self.workflow = workflow
        self.episodes = None if workflow is None else WorkflowRunner(
            workflow.function, tokenizer=tokenizer, response_length=rollout.response_length,
            engine_version=lambda: engine.version, name=workflow.name)
        self.rows, self.params = rows, val_sampling_params(rollout)
        self.n = rollout.val_kwargs.n
        self.max_prompt_length = data.max_prompt_length
        self.truncation = cut_side(data.truncation)
        self.log_generations = trainer.log_val_generations
        self.dump_dir = Path(trainer.validation_data_dir) if trainer.validation_data_dir else None
        self._client = Client(weights_endpoint, keys=keys)
        self.weights = EvalWeights(weights_endpoint, stream_endpoint,
                                   max_waiting=trainer.max_waiting_evals, keys=keys)
        self.evaluated: list[int] = []  # steps, in order

    def run(self, stop: threading.Event) -> None:
        after_step, report = -1, None
        self.weights.start(self.engine.version)
        try:
            self._wait_until_heard(stop)
            while not stop.is_set():
                self.weights.raise_if_died()
                try:
                    reply = self._client.request(
                        EvalRequest(after_step=after_step, report=report), REQUEST_TIMEOUT_S)
                except PeerTimeout:
                    if stop.is_set():
                        return
                    logger.warning("the learner's weight server did not answer; asking again")
                    continue  # the report goes with the next request
                if isinstance(reply, Shutdown):
                    logger.info("the learner says: %s", reply.reason)
                    return
                if isinstance(reply, ErrorReply):  # forbidden: not the evaluator's key
                    raise RuntimeError(f"the learner refused an EvalRequest ({reply.code}): "
                                       f"{reply.detail}; an evaluator host holds the "
                                       "evaluator keys (tools/make-curve-keys.py)")
                if not isinstance(reply, WeightManifest):
                    raise RuntimeError(f"the learner answered an EvalRequest with "
                                       f"{type(reply).__name__}")
                report = None  # delivered
                if reply.step <= after_step:
                    stop.wait(POLL_S)
                    continue
                report = self._evaluate_offer(reply.step, reply.version)
                after_step = reply.step
        finally:
            self.weights.stop()
            self._client.close()
            if self.episodes is not None:
                self.episodes.close()

    def _wait_until_heard(self, stop: threading.Event) -> None:
        """Until a message is heard on the weight stream: the learner beacons until this
        process's first request, or streams versions once it stopped waiting for it; either
        way the subscription has then reached it. Asking before that could lose an offered
        version (the learner may start streaming at once)."""
        waited = 0.0
        while not stop.is_set() and not self.weights.wait_subscribed(SUBSCRIBE_WARN_S):
            waited += SUBSCRIBE_WARN_S
            logger.warning("nothing heard on the learner's weight stream %s for %.0f s; "
                           "still waiting (is the learner up? its log is in the run "
                           "directory's logs/)", self.weights.stream_endpoint, waited)

    def _evaluate_offer(self, step: int, version: int) -> EvalReport:
        if version == 0:
            if self.engine.version != 0:
                raise RuntimeError(f"step {step}: offered the initial checkpoint after "
                                   f"version {self.engine.version}")
            return self.evaluate(step, version)
        staged = self.weights.weights_for(step, version, ARRIVAL_WAIT_S)
        if staged is None:
            logger.warning("step %d: weights version %d did not arrive within %.0f s; not "
                           "evaluated", step, version, ARRIVAL_WAIT_S)
            return EvalReport(step=step, version=version, metrics={})
        self.engine.load_weights(staged.version, staged.tensors)
        self.weights.release(step)
        return self.evaluate(step, version)

    def evaluate(self, step: int, version: int) -> EvalReport:
        began = time.monotonic()
        result = evaluate(self.engine, self.tokenizer, self.rows, self.scorer, self.params,
                          n=self.n, max_prompt_length=self.max_prompt_length,
                          truncation=self.truncation, keep=self.log_generations,
                          record=self.dump_dir is not None, workflow=self.workflow,
                          runner=self.episodes)
        if self.dump_dir is not None:
            path = write_generations(self.dump_dir, step, result.records)
            logger.info("step %d: %d held-out responses written to %s", step,
                        len(result.records), path)
        metrics = eval_metrics(result)
        metrics["perf/eval_seconds"] = time.monotonic() - began
        logger.info("step %d (version %d): held-out accuracy %.3f over %d samples in %.1f s",
                    step, version, result.accuracy, result.samples, metrics["perf/eval_seconds"])
        self.evaluated.append(step)
        return EvalReport(step=step, version=version, metrics=metrics,
                          generations=result.generations)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relay.generators.evaluator")
    parser.add_argument("--run-dir", required=True, help="run directory written by the launcher")
    args = parser.parse_args(argv)
    configure_logging()
    ctx = load_run_dir(args.run_dir)
    run, placement = ctx.run, ctx.topology.evaluator
    if not run.evaluates:
        logger.error("the run config has nothing to evaluate (data.val_files, trainer.test_freq)")
        return 2
    if placement.threads:
        torch.set_num_threads(placement.threads)
    engine, tokenizer = build_engine(run.model, placement, seed=run.trainer.seed,
                                     max_num_seqs=run.rollout.max_num_seqs,
                                     max_len=run.data.max_prompt_length
                                     + run.rollout.response_length,
                                     lora_adapters=publishes_adapters(run, ctx.topology))
    data = run.data
    rows = fit_prompts(load_prompt_rows(data.val_files, prompt_key=data.prompt_key),
                       chat_token_counter(tokenizer), data.max_prompt_length,
                       drop=data.filter_overlong_prompts, refuse=data.truncation == "error",
                       what="data.val_files").rows
    scorer = RewardScorer(run.custom_reward_function, run.sandbox)
    scorer.check_data_sources({row.data_source for row in rows})
    evaluator = Evaluator(weights_endpoint=ctx.weights_endpoint,
                          stream_endpoint=ctx.weights_stream_endpoint, engine=engine,
                          tokenizer=tokenizer, scorer=scorer, rows=rows, rollout=run.rollout,
                          data=run.data, trainer=run.trainer, keys=ctx.client_keys(),
                          workflow=configured_workflow(run.rollout))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with scorer:
        evaluator.run(stop)
    logger.info("evaluator done: %d evaluations (steps %s)", len(evaluator.evaluated),
                evaluator.evaluated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
