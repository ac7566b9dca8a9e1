"""The run's learned rewards as a generator or a reward server builds them.

Two kinds (``reward_model`` in the run config): a discriminative reward model
(``reward_model.enable``, ``relay.generators.reward_model``) and an LLM judge
(``reward_model.judge``, ``relay.generators.judge``). Where they run is the topology's
choice: inside each generator (no ``[[reward_models]]`` entry, the default) or in reward
servers of their own (``relay.generators.reward_server``), which the generators call
(``relay.generators.reward_client``). This module builds the in-process ones for either
kind of process; ``remote_scorers`` builds a generator's clients of the servers.
"""

from __future__ import annotations

import msgspec

from relay.configs.run_schema import ModelConfig, RunConfig
from relay.configs.rundir import RunContext
from relay.configs.topology_schema import GeneratorPlacement
from relay.generators.build import build_engine
from relay.generators.judge import EndpointJudge, EngineJudge, Judge
from relay.generators.reward_client import RemoteJudge, RemoteRewardModel, ScoreClients
from relay.generators.reward_model import RewardModelScorer


class LearnedRewards(msgspec.Struct, kw_only=True):
    """What a generator's sender scores with besides the rule: the reward model and the
    judge, each in this process, behind a reward server, or None when off. ``clients``:
    the reward servers' clients to close at the end (None in-process)."""

    reward_model: RewardModelScorer | RemoteRewardModel | None = None
    judge: Judge | RemoteJudge | None = None
    clients: ScoreClients | None = None

    def close(self) -> None:
        if self.clients is not None:
            self.clients.close()


def discriminative_rm(run: RunConfig, device: str) -> RewardModelScorer | None:
    """The run's discriminative reward model on ``device`` (the process's, unless
    ``reward_model.device`` says), or None: off, or ``reward_model`` is PRIME's PRM."""
    if not run.reward_model.enable or run.algorithm.estimator.prm:
        return None
    return RewardModelScorer(run.reward_model, device)


def vllm_clash(judge_engine: str, process_engine: str, process: str) -> str:
    """Why a judge on ``judge_engine`` cannot be served inside ``process`` whose own engine is
    ``process_engine`` ("" when it can): two vLLM engines in one process collide on
    torch.distributed's default group."""
    if judge_engine != "vllm" or process_engine != "vllm":
        return ""
    return (f"reward_model.judge.engine = 'vllm' would start a second vLLM engine inside "
            f"{process}, whose own engine is vLLM, and two vLLM engines in one process collide "
            "on torch.distributed's default group: serve the judge in a [[reward_models]] "
            "process of the topology, or give it another engine (lean, torch, hf)")


def configured_judge(run: RunConfig, placement: GeneratorPlacement, seed: int,
                     *, beside: str = "") -> Judge | None:
    """The run's LLM judge (``reward_model.judge``): its model on ``judge.engine``, on
    ``placement``'s device with its engine options, or its endpoint; None when off.
    ``beside``: the engine this process already runs ("" for none, a reward server), which
    a vLLM judge may not join (``vllm_clash``: ``ValueError``)."""
    judge, combine = run.reward_model.judge, run.reward_model.combine
    if not judge.enable:
        return None
    if judge.url:
        return EndpointJudge(judge, combine)
    clash = vllm_clash(judge.engine, beside, f"{placement.name!r}")
    if clash:
        raise ValueError(clash)
    engine, tokenizer = build_engine(
        ModelConfig(path=judge.model, dtype=run.model.dtype),
        msgspec.structs.replace(placement, engine=judge.engine), seed,
        max_num_seqs=run.rollout.n, max_len=judge.max_prompt_length + judge.max_new_tokens)
    return EngineJudge(judge, engine, tokenizer, combine)


def remote_scorers(ctx: RunContext) -> LearnedRewards:
    """Clients of the run's reward servers (``[[reward_models]]``) for what the run scores
    with: each request to one server, round-robin, the next one on a timeout
    (``relay.generators.reward_client``)."""
    run = ctx.run
    wants_rm = run.reward_model.enable and not run.algorithm.estimator.prm
    wants_judge = run.reward_model.judge.enable
    if not (wants_rm or wants_judge):
        return LearnedRewards()
    servers = ctx.topology.reward_models
    clients = ScoreClients(ctx.reward_endpoints, keys=ctx.client_keys(),
                           timeout_s=[s.timeout_s for s in servers],
                           patience_s=run.buffer.client_patience_s)
    return LearnedRewards(
        reward_model=RemoteRewardModel(run.reward_model, clients) if wants_rm else None,
        judge=RemoteJudge(run.reward_model.combine, clients) if wants_judge else None,
        clients=clients)


def generator_scorers(ctx: RunContext, placement: GeneratorPlacement,
                      seed: int) -> LearnedRewards:
    """A generator's learned rewards: the reward servers' clients when the topology has
    ``[[reward_models]]``, else the models built in this process beside its engine."""
    if ctx.topology.reward_models:
        return remote_scorers(ctx)
    return LearnedRewards(reward_model=discriminative_rm(ctx.run, placement.device),
                          judge=configured_judge(ctx.run, placement, seed,
                                                 beside=placement.engine))
