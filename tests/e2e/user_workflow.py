"""A user's own rollout workflow, outside the relay package, as a run config names it:
``rollout.workflow = "tests/e2e/user_workflow.py:run_episode"`` (or ``user_workflow:run_episode``
with this folder on PYTHONPATH).

``run_episode`` plays two turns: the policy answers the prompt, a fixed user reply
(``FOLLOW_UP``) is inserted as the chat template renders it (mask 0), and the policy answers
again (mask 1). Its reward is its own: 1.0 when the second turn holds a digit. ``raising``
fails on every prompt: a run must stop, naming the workflow and the prompt.
"""

from __future__ import annotations

from relay.configs.chat_turns import inserted_ids
from relay.generators.workflow import EngineHandle, Episode, EpisodeBuilder, EpisodeRow
from relay.transport.messages import EpisodeStats

FOLLOW_UP = {"role": "user", "content": "Again?"}
FIRST_TURN_SHARE = 4  # the first turn gets at most a quarter of the response budget


async def run_episode(engine: EngineHandle, row: EpisodeRow) -> Episode:
    """Answer, hear ``FOLLOW_UP``, answer again; reward 1.0 when the second answer has a digit."""
    tokenizer = engine.tokenizer
    builder = EpisodeBuilder(engine.response_length)
    first = await engine.generate(row.prompt_ids,
                                  max_new_tokens=max(1, builder.remaining // FIRST_TURN_SHARE))
    builder.sampled(first)
    messages = [*row.messages, {"role": "assistant",
                                "content": tokenizer.decode(first.token_ids,
                                                            skip_special_tokens=True)}]
    between = inserted_ids(tokenizer, messages, [FOLLOW_UP])
    if first.finish_reason == "length":  # the turn never ended: end it as the template does
        between = [tokenizer.eos_token_id, *between]
    builder.episode.stats = EpisodeStats(turns=1)
    if not builder.inserted(between, engine.version) or builder.remaining < 1:
        return builder.episode
    second = await engine.generate(row.prompt_ids + builder.episode.response_ids,
                                   max_new_tokens=builder.remaining)
    builder.sampled(second)
    builder.episode.stats = EpisodeStats(turns=2)
    builder.episode.finish_reason = second.finish_reason
    text = tokenizer.decode(second.token_ids, skip_special_tokens=True)
    builder.episode.reward = 1.0 if any(c.isdigit() for c in text) else 0.0
    return builder.episode


async def raising(engine: EngineHandle, row: EpisodeRow) -> Episode:
    """A broken workflow: it raises on the first prompt it plays."""
    raise RuntimeError(f"user_workflow.raising cannot play {row.prompt_id}")
