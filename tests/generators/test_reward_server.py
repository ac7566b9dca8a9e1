"""A reward server on loopback: its scores through the client equal the in-process scorer's,
a bad request is refused by name and the next one served, replies land on their own items
under concurrent use, and a silent server fails the caller loudly (never a silent 0)."""

from __future__ import annotations

import logging
import random
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from relay.configs.run_schema import JudgeConfig, PrmModelConfig, RewardModelConfig
from relay.generators.judge import EndpointJudge, Verdict
from relay.generators.reward_client import (RemoteJudge, RemoteRewardModel, RewardServerGone,
                                            ScoreClients)
from relay.generators.reward_model import RewardModelScorer
from relay.generators.reward_service import ScoreService
from relay.learner.tiny_model.tokenizer import build_tokenizer
from relay.transport.endpoints import ipc_endpoint
from relay.transport.messages import (ErrorReply, ScoreItem, ScoreReply, ScoreRequest)
from relay.transport.security import ClientKeys, ServerKeys, create_keypair, load_public_key
from relay.transport.sockets import Client, RemoteError, Server, ServerThread

from .test_reward_model import TEXTS, save_rm

MESSAGES = [{"role": "user", "content": "What is 12+7?"}]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_rm(tmp_path_factory.mktemp("rm"))


def rm_config(rm_dir: Path) -> RewardModelConfig:
    return RewardModelConfig(enable=True, model=PrmModelConfig(path=str(rm_dir)),
                             micro_batch_size_per_gpu=3, combine="add")


@pytest.fixture(scope="module")
def local_scorer(rm_dir: Path) -> RewardModelScorer:
    return RewardModelScorer(rm_config(rm_dir), "cpu")


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return ipc_endpoint(tmp_path / "rm-rm0")


@pytest.fixture
def served(endpoint: str, rm_dir: Path) -> Iterator[ScoreService]:
    """A reward server holding the reward model, in a thread, on ``endpoint``."""
    service = ScoreService(RewardModelScorer(rm_config(rm_dir), "cpu"), None)
    with ServerThread(Server(endpoint, service.handle)):
        yield service


def prompt_and_responses(seed: int) -> tuple[list[int], list[list[int]], list[str]]:
    tokenizer = build_tokenizer()
    prompt = tokenizer(f"What is {seed}+7?", add_special_tokens=False)["input_ids"]
    texts = random.Random(seed).sample(TEXTS, k=3)
    return prompt, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], texts


def test_scores_through_the_server_equal_the_in_process_scorer(
        served: ScoreService, endpoint: str, rm_dir: Path,
        local_scorer: RewardModelScorer) -> None:
    clients = ScoreClients([endpoint], keys=None, timeout_s=30, patience_s=60)
    remote = RemoteRewardModel(rm_config(rm_dir), clients)
    try:
        for seed in range(3):
            prompt, responses, texts = prompt_and_responses(seed)
            got = remote.score(MESSAGES, prompt, responses, texts)
            want = local_scorer.score(MESSAGES, prompt, responses, texts)
            assert got == pytest.approx(want, abs=1e-6)
            assert max(got) - min(got) > 1e-3  # the responses are told apart
    finally:
        clients.close()
    assert served.scored == 9 and not served.refused
    assert remote.config.combine == "add"


def raw_request(endpoint: str, message) -> object:
    client = Client(endpoint)
    try:
        return client.request(message, 30)
    finally:
        client.close()


@pytest.mark.parametrize("item, kind, words", [
    (ScoreItem(item_id="a", messages=MESSAGES, prompt_ids=[5], responses=[[6], [7]],
               texts=["x"]), "reward_model", "2 responses but 1 texts"),
    (ScoreItem(item_id="a", messages=MESSAGES, prompt_ids=[5], responses=[[10 ** 6]]),
     "reward_model", "outside the reward model's vocabulary"),
    (ScoreItem(item_id="a", messages=MESSAGES, prompt_ids=[5]), "reward_model",
     "no responses to score"),
    (ScoreItem(item_id="a", messages=MESSAGES, texts=["7"]), "judge", "holds no judge"),
])
def test_a_bad_request_is_refused_by_name_and_the_next_is_served(
        served: ScoreService, endpoint: str, local_scorer: RewardModelScorer,
        item: ScoreItem, kind: str, words: str) -> None:
    reply = raw_request(endpoint, ScoreRequest(request_id="r1", kind=kind, items=[item]))
    assert isinstance(reply, ErrorReply) and reply.code == "bad_request"
    assert words in reply.detail and "'r1'" in reply.detail
    prompt, responses, texts = prompt_and_responses(0)
    good = ScoreItem(item_id="b", messages=MESSAGES, prompt_ids=prompt, responses=responses,
                     texts=texts)
    reply = raw_request(endpoint, ScoreRequest(request_id="r2", kind="reward_model",
                                               items=[good]))
    assert isinstance(reply, ScoreReply) and reply.request_id == "r2"
    assert reply.results[0].scores == pytest.approx(
        local_scorer.score(MESSAGES, prompt, responses, texts), abs=1e-6)


def test_garbage_frames_and_foreign_messages_leave_the_server_serving(
        served: ScoreService, endpoint: str) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"\x00" * 9, b"not relay"])
        assert sock.poll(30_000)
        _envelope, *frames = sock.recv_multipart()
        from relay.transport.codec import Decoder
        assert Decoder().decode(frames).code == "preamble"
    finally:
        sock.close()
    reply = raw_request(endpoint, ErrorReply(code="handler"))
    assert isinstance(reply, ErrorReply) and reply.code == "unexpected"
    prompt, responses, texts = prompt_and_responses(1)
    reply = raw_request(endpoint, ScoreRequest(request_id="ok", kind="reward_model", items=[
        ScoreItem(item_id="i", messages=MESSAGES, prompt_ids=prompt, responses=responses)]))
    assert isinstance(reply, ScoreReply) and len(reply.results[0].scores) == 3


def test_batched_items_come_back_under_their_own_ids(
        served: ScoreService, endpoint: str, local_scorer: RewardModelScorer) -> None:
    items, want = [], {}
    for seed in (4, 2, 7, 0):
        prompt, responses, texts = prompt_and_responses(seed)
        items.append(ScoreItem(item_id=f"p{seed}", messages=MESSAGES, prompt_ids=prompt,
                               responses=responses))
        want[f"p{seed}"] = local_scorer.score(MESSAGES, prompt, responses, texts)
    reply = raw_request(endpoint, ScoreRequest(request_id="batch", kind="reward_model",
                                               items=items))
    assert [r.item_id for r in reply.results] == ["p4", "p2", "p7", "p0"]
    for result in reply.results:
        assert result.scores == pytest.approx(want[result.item_id], abs=1e-6)
    twice = raw_request(endpoint, ScoreRequest(request_id="dup", kind="reward_model",
                                               items=[items[0], items[0]]))
    assert isinstance(twice, ErrorReply) and "given twice" in twice.detail


def test_concurrent_generators_each_get_their_own_scores(
        served: ScoreService, endpoint: str, rm_dir: Path,
        local_scorer: RewardModelScorer) -> None:
    seeds = {name: [random.Random(name).randrange(100) for _ in range(4)]
             for name in range(4)}
    want = {s: local_scorer.score(MESSAGES, *prompt_and_responses(s)[:2],
                                  prompt_and_responses(s)[2])
            for ss in seeds.values() for s in ss}
    failures: list[str] = []

    def generator(name: int) -> None:
        clients = ScoreClients([endpoint], keys=None, timeout_s=60, patience_s=120)
        remote = RemoteRewardModel(rm_config(rm_dir), clients)
        try:
            for seed in seeds[name]:
                prompt, responses, texts = prompt_and_responses(seed)
                got = remote.score(MESSAGES, prompt, responses, texts)
                if got != pytest.approx(want[seed], abs=1e-6):
                    failures.append(f"generator {name}, prompt {seed}: {got} != {want[seed]}")
        except Exception as exc:  # noqa: BLE001 - reported by the test
            failures.append(f"generator {name}: {exc!r}")
        finally:
            clients.close()

    threads = [threading.Thread(target=generator, args=(n,)) for n in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures
    assert served.scored == 3 * 16


def test_a_silent_server_fails_loudly_after_the_patience(tmp_path: Path, rm_dir: Path) -> None:
    clients = ScoreClients([ipc_endpoint(tmp_path / "nobody")], keys=None, timeout_s=0.2,
                           patience_s=0.9, first_pause_s=0.1)
    remote = RemoteRewardModel(rm_config(rm_dir), clients)
    try:
        with pytest.raises(RewardServerGone, match="no reward server answered"):
            remote.score(MESSAGES, [5], [[6]], ["x"])
    finally:
        clients.close()


def test_a_silent_server_is_skipped_for_the_next(served: ScoreService, endpoint: str,
                                                 tmp_path: Path, rm_dir: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    dead = ipc_endpoint(tmp_path / "dead")
    clients = ScoreClients([dead, endpoint], keys=None, timeout_s=[0.3, 30], patience_s=60,
                           first_pause_s=0.05)
    remote = RemoteRewardModel(rm_config(rm_dir), clients)
    prompt, responses, texts = prompt_and_responses(3)
    try:
        with caplog.at_level(logging.WARNING, logger="relay.generators.reward_client"):
            assert len(remote.score(MESSAGES, prompt, responses, texts)) == 3
            assert len(remote.score(MESSAGES, prompt, responses, texts)) == 3
    finally:
        clients.close()
    assert clients.served == [0, 2]
    assert f"reward server {dead} did not answer" in caplog.text


def test_a_refusal_raises_in_the_caller(served: ScoreService, endpoint: str) -> None:
    clients = ScoreClients([endpoint], keys=None, timeout_s=30, patience_s=60)
    try:
        with pytest.raises(RemoteError, match="holds no judge"):
            RemoteJudge("replace", clients).judge(MESSAGES, ["7"], "7")
    finally:
        clients.close()


def test_a_judge_behind_the_server_gives_the_judges_verdicts(tmp_path: Path) -> None:
    class FixedJudge(EndpointJudge):
        def answer(self, prompt: str) -> str:
            return "Grade: 0.5" if "seven" in prompt else "I cannot say"

    service = ScoreService(None, FixedJudge(JudgeConfig(enable=True, url="http://unused")))
    endpoint = ipc_endpoint(tmp_path / "judge")
    with ServerThread(Server(endpoint, service.handle)):
        clients = ScoreClients([endpoint], keys=None, timeout_s=30, patience_s=60)
        try:
            verdicts = RemoteJudge("add", clients).judge(MESSAGES, ["seven", "8"], "7")
        finally:
            clients.close()
    assert verdicts[0] == Verdict(0.5, "", "")
    assert verdicts[1].score == 0.0 and "no number" in verdicts[1].error


def test_curve_a_generator_key_is_served_on_tcp(tmp_path: Path, rm_dir: Path,
                                                local_scorer: RewardModelScorer) -> None:
    keys = tmp_path / "keys"
    for name in ("server", "generator", "evaluator"):
        create_keypair(keys, name)
    (keys / "authorized").mkdir()
    for name in ("generator", "evaluator"):
        shutil.copy(keys / f"{name}.key", keys / "authorized" / f"{name}.key")
    from relay.transport.security import load_keypair
    server_keys = ServerKeys(load_keypair(keys / "server.key_secret"), keys / "authorized")
    service = ScoreService(RewardModelScorer(rm_config(rm_dir), "cpu"), None)
    with ServerThread(Server("tcp://127.0.0.1:*", service.handle, keys=server_keys)) as thread:
        endpoint = thread.server.endpoint
        prompt, responses, texts = prompt_and_responses(5)

        def client_keys(name: str) -> ClientKeys:
            return ClientKeys(load_keypair(keys / f"{name}.key_secret"),
                              load_public_key(keys / "server.key"))

        clients = ScoreClients([endpoint], keys=client_keys("generator"), timeout_s=30,
                               patience_s=60)
        try:
            got = RemoteRewardModel(rm_config(rm_dir), clients).score(
                MESSAGES, prompt, responses, texts)
        finally:
            clients.close()
        assert got == pytest.approx(local_scorer.score(MESSAGES, prompt, responses, texts),
                                    abs=1e-6)
        foreign = ScoreClients([endpoint], keys=client_keys("evaluator"), timeout_s=30,
                               patience_s=60)
        try:
            with pytest.raises(RemoteError, match="forbidden"):
                RemoteRewardModel(rm_config(rm_dir), foreign).score(
                    MESSAGES, prompt, responses, texts)
        finally:
            foreign.close()
