"""The LLM judge (``reward_model.judge``): scores follow the parse rule, on the lean engine
and behind an OpenAI-compatible endpoint; unparseable answers and timeouts score 0 with the
reason."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from relay.configs.run_schema import JudgeConfig, ModelConfig
from relay.configs.topology_schema import GeneratorPlacement
from relay.generators.build import build_engine
from relay.generators.judge import (EndpointJudge, EngineJudge, Verdict, judge_prompt,
                                    parse_score)
from relay.generators.sampling import SamplingParams

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4?"}]
TEXTS = ["7", "It is 8.", "seven", "<answer>7</answer>"]


@pytest.mark.parametrize("answer, score", [
    ("Grade: 0.8", 0.8), ("3 of 5 steps hold, so 1", 1.0), ("7", 1.0), ("-2", 0.0),
    ("0.25 then 0.5", 0.5), ("1e3", 1.0)])
def test_the_last_number_clipped_to_0_1(answer: str, score: float) -> None:
    assert parse_score(answer) == Verdict(score, answer)


def test_no_number_is_0_with_an_error() -> None:
    verdict = parse_score("I cannot grade this")
    assert verdict.score == 0.0 and "no number" in verdict.error


def test_the_template_fields() -> None:
    text = judge_prompt("{prompt}|{response}|{ground_truth}", MESSAGES, "7", 7)
    assert text == "Be brief.\n\n3+4?|7|7"
    with pytest.raises(ValueError, match="prompt_template"):
        EndpointJudge(JudgeConfig(url="http://x", prompt_template="{answer}"))


def test_a_judge_on_the_lean_engine_scores_as_its_parse_rule_says(
        random_model_dir: Path) -> None:
    config = JudgeConfig(enable=True, model=str(random_model_dir), max_new_tokens=12,
                         prompt_template="Q: {prompt} A: {response} ({ground_truth}) Grade 0-1:")
    engine, tokenizer = build_engine(ModelConfig(path=str(random_model_dir), dtype="float32"),
                                     GeneratorPlacement(name="judge", engine="lean"), 0,
                                     max_num_seqs=4, max_len=512)
    judge = EngineJudge(config, engine, tokenizer)
    verdicts = judge.judge(MESSAGES, TEXTS, "7")
    # the same prompts through the engine by hand, greedy, parsed by the rule
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": judge_prompt(config.prompt_template, MESSAGES, t, "7")}],
        add_generation_prompt=True, tokenize=True, return_dict=False) for t in TEXTS]
    answers = [tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True)
               for c in engine.generate(prompts, SamplingParams(max_new_tokens=12,
                                                                temperature=0.0))]
    assert verdicts == [parse_score(a) for a in answers]
    assert all(v.answer for v in verdicts)
    short = EngineJudge(JudgeConfig(enable=True, model="m", max_prompt_length=8), engine,
                        tokenizer)
    too_long = short.judge(MESSAGES, TEXTS[:1], "7")
    assert too_long[0].score == 0.0 and "max_prompt_length = 8" in too_long[0].error


class Grader(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint: answers by the response it is asked about."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["temperature"] == 0.0 and body["model"] == "grader"
        prompt = body["messages"][0]["content"]
        if "SLOW" in prompt:
            time.sleep(1.5)
        content = "hmm" if "GARBLED" in prompt else "Looks right. Grade: 0.75"
        reply = json.dumps({"choices": [{"message": {"content": content}}]}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)
        except BrokenPipeError:  # the judge gave up on the slow one: as meant
            pass

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Grader)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_an_endpoint_judge_parses_and_records_failures(endpoint: str) -> None:
    judge = EndpointJudge(JudgeConfig(enable=True, url=endpoint, model_name="grader",
                                      prompt_template="{response}", timeout_s=0.5))
    good, garbled, slow = judge.judge(MESSAGES, ["7", "GARBLED", "SLOW"], "7")
    assert good == Verdict(0.75, "Looks right. Grade: 0.75")
    assert garbled.score == 0.0 and "no number" in garbled.error
    assert slow.score == 0.0 and "timeout" in slow.error
    closed = EndpointJudge(JudgeConfig(enable=True, url="http://127.0.0.1:9/v1",
                                       timeout_s=0.5)).judge(MESSAGES, ["7"], "7")
    assert closed[0].score == 0.0 and closed[0].error.startswith("judge: http://127.0.0.1:9")
