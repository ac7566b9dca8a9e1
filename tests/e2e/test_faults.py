"""Hostile peers against a live run: refused, counted, and the run trains on.

Both tests start a real run, wait until it trains, and then, from this process:

- without CURVE (loopback): a connection that acted as a generator sends every learner
  message (the end of the run, a batch request, an absurd version, a checkpoint request):
  each is refused as ``forbidden``. A connection that takes the learner role (possible
  without keys, the documented limit of a keyless run) sends out-of-range requests: each
  is refused as ``bad_request``. A hostile generator leases a prompt and answers with token
  ids outside the vocabulary (refused as malformed, the prompt back in the pool); garbage
  frames and an oversize frame are dropped; NaN metrics go to the launcher's status line.
- with CURVE: a peer holding the generator key (what every generator host holds) sends
  every learner message: all refused as ``forbidden``; a peer with no key or a key the
  buffer does not know gets no answer at all.

Then the run must finish with exit code 0, the refusals must be counted in the buffer's
metrics, and the buffer's accounting must hold (``buffer/accounting_problems`` = 0).
Faults of processes (SIGKILL, SIGSTOP, SIGTERM, resume) are in ``test_failures.py`` and
``test_resume.py``; attaching and detaching in ``test_attach.py``.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import zmq
from mlflow.tracking import MlflowClient

from configs.rundir import RunContext, load_run_dir
from transport.messages import (
    Attach,
    AttachAck,
    BufferCheckpointRequest,
    Detach,
    ErrorReply,
    Heartbeat,
    LeaseRequest,
    Metrics,
    PromptLease,
    RolloutAck,
    RolloutGroup,
    Sample,
    SampleRequest,
    Shutdown,
    VersionUpdate,
)
from transport.security import ClientKeys, create_keypair, load_keypair, load_public_key
from transport.sockets import Client, PeerTimeout, Pusher

from .conftest import ROOT, processes_mentioning, small_run_overrides
from .test_failures import first_run_dir, start_launcher, wait_for

pytestmark = pytest.mark.e2e

LEARNER_MESSAGES = (Shutdown(reason="hostile"), SampleRequest(num_groups=1),
                    VersionUpdate(version=10**12, step=1), BufferCheckpointRequest(step=1))
MAX_MESSAGE_BYTES = 1 << 16


def run_args(model_dir: Path, run_root: Path, *extra: str) -> list[str]:
    return small_run_overrides(model_dir, run_root, steps=100) + [
        "rollout.response_length=16", "trainer.val_before_train=false", "trainer.test_freq=-1",
        f"buffer.max_message_bytes={MAX_MESSAGE_BYTES}", *extra]


def last_metric(run_dir: Path, name: str) -> float:
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.step)
    return history[-1].value


def started_run(model_dir: Path, run_root: Path, *extra: str):
    launcher = start_launcher(run_args(model_dir, run_root, *extra))
    run_dir = first_run_dir(run_root)
    wait_for(run_dir / "logs" / "buffer.log", r"generator \S+ attached", 180)
    return launcher, run_dir


def finish(launcher, run_dir: Path) -> str:
    output, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, output
    assert processes_mentioning(str(run_dir)) == []
    assert last_metric(run_dir, "buffer/accounting_problems") == 0
    return output


def refuse_learner_messages(client: Client) -> None:
    for message in LEARNER_MESSAGES:
        reply = client.request(message, 10.0)
        assert isinstance(reply, ErrorReply) and reply.code == "forbidden", (message, reply)


def hostile_group(lease: PromptLease) -> RolloutGroup:
    prompt = lease.prompts[0]
    sample = Sample(prompt_ids=torch.tensor([1, 2], dtype=torch.int32),
                    response_ids=torch.tensor([10**6, 3], dtype=torch.int32),
                    logprobs=torch.zeros(2), versions=torch.zeros(2, dtype=torch.int32),
                    reward=1.0)
    return RolloutGroup(rollout_id="hostile-1", lease_id=lease.lease_id,
                        prompt_id=prompt.prompt_id, generator_id="intruder",
                        samples=[sample] * lease.n)


def send_raw(ctx: RunContext, frames: list[bytes]) -> None:
    """Frames a codec never made, on a bare socket."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 1000)
    socket.connect(ctx.buffer_endpoint)
    socket.send_multipart(frames)
    socket.close()


@pytest.mark.slow
def test_a_hostile_peer_without_keys_is_refused_and_the_run_trains_on(
        random_model_dir: Path, run_root: Path) -> None:
    launcher, run_dir = started_run(random_model_dir, run_root)
    ctx = load_run_dir(run_dir)
    generator, learner = Client(ctx.buffer_endpoint), Client(ctx.buffer_endpoint)
    metrics = Pusher(ctx.metrics_endpoint)
    try:
        assert generator.request(Heartbeat(generator_id="intruder", version=0), 10.0)
        refuse_learner_messages(generator)

        for message in (SampleRequest(num_groups=-1), SampleRequest(num_groups=1, step=10**9),
                        VersionUpdate(version=10**12, step=10**12)):
            reply = learner.request(message, 10.0)
            assert isinstance(reply, ErrorReply) and reply.code == "bad_request", reply

        attach = generator.request(Attach(generator_id="intruder", engine="x", device="x"), 10.0)
        assert isinstance(attach, AttachAck) and attach.accepted
        lease = PromptLease(lease_id="")
        while not lease.lease_id:
            lease = generator.request(LeaseRequest(generator_id="intruder", max_prompts=1), 10.0)
        ack = generator.request(hostile_group(lease), 10.0)
        assert isinstance(ack, RolloutAck) and ack.verdict == "malformed", ack
        generator.request(Detach(generator_id="intruder", reason="done"), 10.0)

        send_raw(ctx, [b"not a message"])
        send_raw(ctx, [b"\x00" * (2 * MAX_MESSAGE_BYTES)])
        nan = float("nan")
        metrics.send(Metrics(source="learner", step=0, values={"version": nan,
                                                               "rollout/reward_mean": nan}))
        metrics.send(Metrics(source="buffer", step=0, values={"buffer/generators": nan,
                                                              "buffer/occupancy": math.inf}))
    finally:
        generator.close()
        learner.close()
        metrics.close(linger_s=1.0)
    finish(launcher, run_dir)
    assert last_metric(run_dir, "buffer/rejected/forbidden") >= len(LEARNER_MESSAGES)
    assert last_metric(run_dir, "buffer/rejected/bad_request") >= 3
    assert last_metric(run_dir, "buffer/rejected/malformed") >= 1
    buffer_log = (run_dir / "logs" / "buffer.log").read_text()
    assert "refused Shutdown" in buffer_log and "rejected rollout hostile-1" in buffer_log


def make_keys(keys_dir: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_curve_keys",
                                                  ROOT / "tools" / "make-curve-keys.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_keys(keys_dir)


@pytest.mark.slow
def test_a_generator_key_cannot_act_as_the_learner_and_no_key_gets_no_answer(
        random_model_dir: Path, run_root: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    make_keys(keys)
    launcher, run_dir = started_run(random_model_dir, run_root,
                                    "topology.security.curve=true",
                                    f"topology.security.keys_dir={keys / 'control'}")
    ctx = load_run_dir(run_dir)
    generator_keys = ClientKeys(keypair=load_keypair(keys / "generator" / "client.key_secret"),
                                server_public_key=load_public_key(keys / "generator" / "server.key"))
    create_keypair(tmp_path / "stranger", "client")
    stranger_keys = ClientKeys(keypair=load_keypair(tmp_path / "stranger" / "client.key_secret"),
                               server_public_key=generator_keys.server_public_key)
    holder = Client(ctx.buffer_endpoint, keys=generator_keys)
    try:
        refuse_learner_messages(holder)
    finally:
        holder.close()
    for keys_held in (None, stranger_keys):
        outsider = Client(ctx.buffer_endpoint, keys=keys_held)
        try:
            with pytest.raises(PeerTimeout):
                outsider.request(Shutdown(reason="hostile"), 3.0)
        finally:
            outsider.close()
    finish(launcher, run_dir)
    assert last_metric(run_dir, "buffer/rejected/forbidden") >= len(LEARNER_MESSAGES)
