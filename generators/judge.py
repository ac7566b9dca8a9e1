"""A generative reward model (LLM as judge, ``reward_model.judge``), asked inside a generator.

For each response the judge gets one user message, ``prompt_template`` with its fields
filled in:

- ``{prompt}``: the contents of the prompt's chat messages, joined by blank lines;
- ``{response}``: the response's text;
- ``{ground_truth}``: the row's ground truth (``str()``; empty when there is none).

The judge is either a model served in this process by one of Relay's engines
(``EngineJudge``: greedy, at most ``max_new_tokens``, the judge tokenizer's chat template
when it has one) or an OpenAI-compatible endpoint (``EndpointJudge``: ``POST
{url}/chat/completions`` with ``temperature = 0``, one request per response, each within
``timeout_s``).

The parse rule (``parse_score``): the score is the LAST number in the judge's answer
(``-?\\d+(\\.\\d+)?``; ``1e3`` reads as ``3``), clipped to [0, 1]. An answer without a
number, a request that fails or times out, gives score 0.0 with the reason as the sample's
reward error, as a failing reward function does.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, Union

import msgspec

from relay.configs.run_schema import JudgeConfig, RewardCombine
from relay.generators.engine import Engine
from relay.generators.sampling import SamplingParams

Judge = Union["EngineJudge", "EndpointJudge"]
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
MAX_ERROR_CHARS = 300


class Verdict(msgspec.Struct, frozen=True):
    """The judge's score of one response, its raw answer, and why it is 0 when it failed."""

    score: float
    answer: str = ""
    error: str = ""


def parse_score(answer: str) -> Verdict:
    """The last number in ``answer``, clipped to [0, 1]; none: 0.0 with an error."""
    numbers = NUMBER.findall(answer)
    if not numbers:
        return Verdict(0.0, answer, f"judge: no number in its answer {answer[-80:]!r}")
    return Verdict(min(max(float(numbers[-1]), 0.0), 1.0), answer)


def judge_prompt(template: str, messages: Sequence[dict[str, Any]], response: str,
                 ground_truth: Any) -> str:
    """``template`` with ``{prompt}``, ``{response}`` and ``{ground_truth}`` filled in."""
    prompt = "\n\n".join(str(m.get("content", "")) for m in messages)
    return template.format(prompt=prompt, response=response,
                           ground_truth="" if ground_truth is None else str(ground_truth))


def check_template(config: JudgeConfig) -> None:
    """``ValueError`` naming the key when the template uses a field it cannot have."""
    if problem := config.template_problem():
        raise ValueError(f"reward_model.judge.prompt_template: {problem}")


class EngineJudge:
    """A judge model served by a Relay engine in this process (greedy decoding); its score
    meets the rule's as ``combine`` says (``reward_model.combine``)."""

    def __init__(self, config: JudgeConfig, engine: Engine, tokenizer,
                 combine: RewardCombine = "replace") -> None:
        check_template(config)
        self.config, self.engine, self.tokenizer = config, engine, tokenizer
        self.combine = combine
        self.params = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=0.0)

    def prompt_ids(self, text: str) -> list[int]:
        """The judge prompt as one user turn, in the judge's chat template when it has one."""
        if getattr(self.tokenizer, "chat_template", None):
            return list(self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True,
                tokenize=True, return_dict=False))
        return list(self.tokenizer(text)["input_ids"])

    def answers(self, prompts: Sequence[Sequence[int]]) -> list[str]:
        """The judge's greedy answers to ``prompts`` (token ids), decoded."""
        completions = self.engine.generate(prompts, self.params)
        return [self.tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True)
                for c in completions]

    def judge(self, messages: Sequence[dict[str, Any]], texts: Sequence[str],
              ground_truth: Any) -> list[Verdict]:
        """One verdict per response to the prompt (one batched generation)."""
        ids = [self.prompt_ids(judge_prompt(self.config.prompt_template, messages, t,
                                            ground_truth)) for t in texts]
        limit = self.config.max_prompt_length
        verdicts: list[Verdict | None] = [
            Verdict(0.0, "", f"judge: its prompt has {len(p)} tokens, over "
                             f"reward_model.judge.max_prompt_length = {limit}")
            if len(p) > limit else None for p in ids]
        asked = [i for i, v in enumerate(verdicts) if v is None]
        try:
            answers = self.answers([ids[i] for i in asked]) if asked else []
        except Exception as exc:  # noqa: BLE001 - a failing judge scores 0, recorded
            answers = []
            failed = Verdict(0.0, "", f"judge: {type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS])
            for i in asked:
                verdicts[i] = failed
        for i, answer in zip(asked, answers, strict=False):
            verdicts[i] = parse_score(answer)
        return verdicts  # type: ignore[return-value]  # every slot is filled above


class EndpointJudge:
    """A judge behind an OpenAI-compatible ``/chat/completions`` endpoint (urllib); its
    score meets the rule's as ``combine`` says."""

    def __init__(self, config: JudgeConfig, combine: RewardCombine = "replace") -> None:
        check_template(config)
        self.config, self.combine = config, combine
        self.endpoint = config.url.rstrip("/") + "/chat/completions"

    def answer(self, prompt: str) -> str:
        """The endpoint's answer to one judge prompt; raises on any failure."""
        body = json.dumps({"model": self.config.model_name,
                           "messages": [{"role": "user", "content": prompt}],
                           "temperature": 0.0, "max_tokens": self.config.max_new_tokens})
        request = urllib.request.Request(self.endpoint, data=body.encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.config.timeout_s) as reply:
            payload = json.loads(reply.read())
        content = payload["choices"][0]["message"]["content"]
        if not isinstance(content, str):
            raise ValueError(f"the answer's content is a {type(content).__name__}")
        return content

    def judge(self, messages: Sequence[dict[str, Any]], texts: Sequence[str],
              ground_truth: Any) -> list[Verdict]:
        """One verdict per response, one request each within ``timeout_s``."""
        verdicts = []
        for text in texts:
            prompt = judge_prompt(self.config.prompt_template, messages, text, ground_truth)
            try:
                verdicts.append(parse_score(self.answer(prompt)))
            except TimeoutError:
                verdicts.append(Verdict(0.0, "", f"judge: timeout: no answer within "
                                                 f"{self.config.timeout_s:g} s"))
            except urllib.error.URLError as exc:
                reason = "timeout" if isinstance(exc.reason, TimeoutError) else exc.reason
                verdicts.append(Verdict(0.0, "", f"judge: {self.endpoint}: {reason}"
                                        [:MAX_ERROR_CHARS]))
            except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
                verdicts.append(Verdict(0.0, "", f"judge: {type(exc).__name__}: {exc}"
                                        [:MAX_ERROR_CHARS]))
        return verdicts
