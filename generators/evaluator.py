"""The evaluator: ``python -m generators.evaluator --run-dir RUN_DIR``.

Held-out evaluation as a job of its own, so that no learner step ever waits for it. The
launcher starts it when the run has validation data (``RunConfig.evaluates``), where the
topology's ``evaluator`` section says. The learner's rank 0 offers the weights it had
newest published version at each evaluation step (step 0 with
``trainer.val_before_train``, every ``trainer.test_freq`` steps, the last step) on its
weight server; this process asks for the
next offer (``EvalRequest``), loads it into its own engine, decodes the validation prompts
(``generators.evaluate``) and hands the metrics back with its next request. The learner
logs them against the step whose weights they measured. When evaluation is slower than
the offers come, they wait in the learner's queue (``learner.eval_queue``), the oldest
skipped past ``trainer.max_waiting_evals``. The evaluator exits when the learner says the
run is over.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time

import torch

from algorithms.rewards.scorer import RewardScorer
from buffer.dataset import PromptRow, load_prompt_rows
from configs.rundir import configure_logging, load_run_dir
from generators.build import build_engine
from generators.engine import Engine
from generators.evaluate import eval_metrics, evaluate
from generators.sampling import SamplingParams
from generators.weight_receiver import IncompleteVersion, receive_version
from transport.messages import EvalReport, EvalRequest, Shutdown
from transport.security import ClientKeys
from transport.sockets import Client, PeerTimeout

logger = logging.getLogger("relay.evaluator")

POLL_S = 0.5  # between requests while nothing new is offered
REQUEST_TIMEOUT_S = 10.0


class Evaluator:
    """Asks for weights to evaluate, evaluates them, reports, until the run is over."""

    def __init__(self, *, weights_endpoint: str, engine: Engine, tokenizer,
                 scorer: RewardScorer, rows: list[PromptRow], params: SamplingParams, n: int,
                 max_prompt_length: int, keys: ClientKeys | None = None) -> None:
        self.engine, self.tokenizer, self.scorer = engine, tokenizer, scorer
        self.rows, self.params, self.n = rows, params, n
        self.max_prompt_length = max_prompt_length
        self._client = Client(weights_endpoint, keys=keys)
        self.evaluated: list[int] = []  # steps, in order

    def run(self, stop: threading.Event) -> None:
        after_step, report = -1, None
        try:
            while not stop.is_set():
                try:
                    replies = self._client.request_stream(
                        EvalRequest(after_step=after_step, report=report), REQUEST_TIMEOUT_S)
                    first = next(replies)
                    if isinstance(first, Shutdown):
                        logger.info("the learner says: %s", first.reason)
                        return
                    manifest, staged = receive_version(first, replies)
                except PeerTimeout:
                    if stop.is_set():
                        return
                    logger.warning("the learner's weight server did not answer; asking again")
                    continue  # the report goes with the next request
                except IncompleteVersion as exc:
                    raise RuntimeError(f"the learner sent unusable weights: {exc}") from exc
                report = None  # delivered
                if manifest.step <= after_step:
                    stop.wait(POLL_S)
                    continue
                if staged is not None:
                    self.engine.load_weights(staged.version, staged.tensors)
                elif self.engine.version != 0:
                    raise RuntimeError(f"step {manifest.step}: offered the initial checkpoint "
                                       f"after version {self.engine.version}")
                report = self.evaluate(manifest.step, manifest.version)
                after_step = manifest.step
        finally:
            self._client.close()

    def evaluate(self, step: int, version: int) -> EvalReport:
        began = time.monotonic()
        result = evaluate(self.engine, self.tokenizer, self.rows, self.scorer, self.params,
                          n=self.n, max_prompt_length=self.max_prompt_length)
        metrics = eval_metrics(result)
        metrics["perf/eval_seconds"] = time.monotonic() - began
        logger.info("step %d (version %d): held-out accuracy %.3f over %d samples in %.1f s",
                    step, version, result.accuracy, result.samples, metrics["perf/eval_seconds"])
        self.evaluated.append(step)
        return EvalReport(step=step, version=version, metrics=metrics)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m generators.evaluator")
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
    engine, tokenizer = build_engine(run.model, placement.engine, placement.device,
                                     seed=run.trainer.seed,
                                     max_num_seqs=run.rollout.max_num_seqs,
                                     max_len=run.data.max_prompt_length
                                     + run.rollout.response_length)
    rows = load_prompt_rows(run.data.val_files)
    scorer = RewardScorer(run.custom_reward_function)
    scorer.check_data_sources({row.data_source for row in rows})
    val = run.rollout.val_kwargs
    params = SamplingParams(max_new_tokens=run.rollout.response_length,
                            temperature=val.temperature, top_p=val.top_p, top_k=val.top_k)
    evaluator = Evaluator(weights_endpoint=ctx.weights_endpoint, engine=engine,
                          tokenizer=tokenizer, scorer=scorer, rows=rows, params=params,
                          n=val.n, max_prompt_length=run.data.max_prompt_length,
                          keys=ctx.client_keys())
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
