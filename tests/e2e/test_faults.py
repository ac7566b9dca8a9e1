"""Hostile peers and dead processes against a live run: refused, counted, accounted for.

Every test starts a real run, waits until it trains, and then probes it from this process:

- without CURVE (loopback): a connection that acted as a generator sends every learner
  message (the end of the run, batch requests, an absurd version, a checkpoint request):
  each is refused as ``forbidden``. A connection that takes the learner role (possible
  without keys, the documented limit of a keyless run) sends out-of-range requests (each
  refused as ``bad_request``) and then generator messages (``forbidden``: a connection keeps
  its first role). A hostile generator leases a prompt and answers with token ids outside
  the vocabulary (refused as malformed, the prompt back in the pool) and detaches the run's
  real generator under its name (it attaches again). Frames no codec made get an
  ``ErrorReply`` naming the fault, from the buffer and from the learner's weight server; a
  message over ``buffer.max_message_bytes`` gets no answer (ZeroMQ drops the connection);
  NaN metrics and garbage go to the launcher's metrics address.
- with CURVE: a peer holding the generator key (what every generator host holds) sends
  every learner message: all refused as ``forbidden``; a peer with no key or a key the
  buffer does not know gets no answer at all.
- a generator SIGKILLed while it holds a lease: its prompts expire back into the pool.
- a disk fault: the learner's checkpoint folder lies under a regular file; and an operator
  who presses Ctrl-C a second time while the launcher stops the run.

Then a run probed by peers must finish with exit code 0, the refusals must be counted in
the buffer's metrics, and the buffer's accounting must hold, checked from the outside on
the counters it reports (MLflow, at every step, and its final ``buffer done`` log line):
``leased = completed + returned + expired + in flight``, ``completed = accepted +
malformed + stale on arrival + dropped by a filter + failed + store errors`` and
``accepted = trained + dropped stale + stored``, with ``buffer/accounting_problems`` = 0.

Four more probes: a dead learner's exception must be named in the launcher's message; a
second Ctrl-C while the run stops must leave nothing behind (exit 130); a learner step
spoofed on the metrics address must not blind the launcher's watchdog; an absurd evaluation
report sent to the weight server must not kill the learner. A failed ``precondition`` (a
step of the probe, not what it checks) names itself.

Faults of processes (SIGKILL, SIGSTOP, SIGTERM, Ctrl-C, resume) are in ``test_failures.py``
and ``test_resume.py``; attaching and detaching in ``test_attach.py``.
"""

from __future__ import annotations

import ast
import contextlib
import math
import os
import re
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
from mlflow.tracking import MlflowClient

from relay import keys
from relay.configs.rundir import load_run_dir
from relay.transport.codec import PREAMBLE_FRAME, WIRE_ERROR_KINDS, Decoder
from relay.transport.messages import (
    Attach,
    AttachAck,
    BufferCheckpointRequest,
    Detach,
    ErrorReply,
    EvalReport,
    EvalRequest,
    Heartbeat,
    LeaseRequest,
    Message,
    Metrics,
    PromptLease,
    RolloutAck,
    RolloutGroup,
    Sample,
    SampleRequest,
    Shutdown,
    VersionUpdate,
    WeightManifest,
)
from relay.transport.security import ClientKeys, create_keypair, load_keypair, load_public_key
from relay.transport.sockets import Client, PeerTimeout, Pusher

from .conftest import ROOT, launch, processes_mentioning, small_run_overrides
from .test_failures import (
    TOPOLOGY,
    first_run_dir,
    pid_of,
    start_launcher,
    wait_for,
    wait_for_any,
)

pytestmark = pytest.mark.e2e

LEARNER_MESSAGES = (Shutdown(reason="hostile"), SampleRequest(num_groups=1),
                    SampleRequest(num_groups=-1), VersionUpdate(version=10**12, step=1),
                    BufferCheckpointRequest(step=1))
GENERATOR_MESSAGES = (Heartbeat(generator_id="intruder", version=0),
                      LeaseRequest(generator_id="intruder", max_prompts=1),
                      Attach(generator_id="intruder", engine="x", device="x"))
MAX_MESSAGE_BYTES = 1 << 16
WEIGHT_SERVER_MAX_BYTES = 1 << 20  # relay.learner.weights.MAX_REQUEST_BYTES
ENVELOPE = struct.Struct(">QB")  # relay.transport.sockets: request id, flags

# Where every prompt and group went (relay.buffer.hub, "Accounting"), as ``buffer/...`` keys
PROMPT_ENDS = ("prompts/completed", "prompts/returned", "prompts/expired", "running_prompts")
ANSWERS = ("groups/accepted", "rejected/malformed", "dropped/stale_on_arrival",
           "dropped/zero_variance", "groups/failed", "groups/store_errors")
ADMITTED = ("groups/trained", "dropped/stale", "groups/stored")
ACCOUNTING_KEYS = ("prompts/leased", *PROMPT_ENDS, *ANSWERS, *ADMITTED, "accounting_problems")


def run_args(model_dir: Path, run_root: Path, *extra: str, steps: int = 100) -> list[str]:
    return small_run_overrides(model_dir, run_root, steps=steps) + [
        "rollout.response_length=16", "trainer.val_before_train=false", "trainer.test_freq=-1",
        f"buffer.max_message_bytes={MAX_MESSAGE_BYTES}", *extra]


def mlflow_run(run_dir: Path) -> tuple[MlflowClient, str]:
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return client, run.info.run_id


def last_metric(run_dir: Path, name: str) -> float:
    client, run_id = mlflow_run(run_dir)
    history = sorted(client.get_metric_history(run_id, name), key=lambda m: m.step)
    return history[-1].value


def buffer_stats_by_step(run_dir: Path) -> dict[int, dict[str, float]]:
    """The buffer's counters the learner logged with each step (``buffer/`` dropped)."""
    client, run_id = mlflow_run(run_dir)
    steps: dict[int, dict[str, float]] = {}
    for key in ACCOUNTING_KEYS:
        for metric in client.get_metric_history(run_id, f"buffer/{key}"):
            steps.setdefault(metric.step, {})[key] = metric.value
    return steps


def buffer_done_stats(run_dir: Path) -> dict[str, float]:
    """The buffer's counters in its last log line (``buffer/`` dropped; those it leaves
    out are 0)."""
    done = re.findall(r"buffer done: (\{.*\})", (run_dir / "logs" / "buffer.log").read_text())
    assert done, f"the buffer never logged its final counters in {run_dir / 'logs'}"
    return {k.removeprefix("buffer/"): v for k, v in ast.literal_eval(done[-1]).items()}


def accounting_failures(stats: Mapping[str, float]) -> list[str]:
    """Each accounting sum that ``stats`` break, with its numbers (relay.buffer.hub)."""
    get = lambda key: stats.get(key, 0.0)  # noqa: E731
    failures = []
    for total, parts in (("prompts/leased", PROMPT_ENDS), ("prompts/completed", ANSWERS),
                         ("groups/accepted", ADMITTED)):
        if get(total) != sum(get(part) for part in parts):
            failures.append(f"{total} {get(total)} != " +
                            " + ".join(f"{part} {get(part)}" for part in parts))
    if get("accounting_problems"):
        failures.append(f"the buffer reports {get('accounting_problems')} accounting problems")
    return failures


def assert_accounting_holds(run_dir: Path) -> dict[str, float]:
    """The accounting holds at every logged step and at the buffer's end; returns the
    buffer's final counters."""
    steps = buffer_stats_by_step(run_dir)
    assert steps, "the learner logged no buffer counters"
    for step, stats in sorted(steps.items()):
        assert set(stats) == set(ACCOUNTING_KEYS), f"step {step} lacks counters: {stats}"
        assert not accounting_failures(stats), (step, accounting_failures(stats))
    final = buffer_done_stats(run_dir)
    assert not accounting_failures(final), accounting_failures(final)
    return final


def started_run(model_dir: Path, run_root: Path, *extra: str, steps: int = 100):
    """A run that trains, and the name of its first generator once it has attached."""
    launcher = start_launcher(run_args(model_dir, run_root, *extra, steps=steps))
    run_dir = first_run_dir(run_root)
    attached = wait_for(run_dir / "logs" / "buffer.log", r"generator (\S+) attached", 180)
    return launcher, run_dir, attached.group(1)


def finish(launcher, run_dir: Path) -> tuple[str, dict[str, float]]:
    """The run's output once it has ended well, and the buffer's final counters."""
    output, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, output
    assert processes_mentioning(str(run_dir)) == []
    return output, assert_accounting_holds(run_dir)


def refused(client: Client, messages: tuple[Message, ...], code: str) -> None:
    for message in messages:
        reply = client.request(message, 10.0)
        assert isinstance(reply, ErrorReply) and reply.code == code, (message, reply)


def hostile_group(lease: PromptLease) -> RolloutGroup:
    prompt = lease.prompts[0]
    sample = Sample(prompt_ids=torch.tensor([1, 2], dtype=torch.int32),
                    response_ids=torch.tensor([10**6, 3], dtype=torch.int32),
                    logprobs=torch.zeros(2), versions=torch.zeros(2, dtype=torch.int32),
                    reward=1.0)
    return RolloutGroup(rollout_id="hostile-1", lease_id=lease.lease_id,
                        prompt_id=prompt.prompt_id, generator_id="intruder",
                        samples=[sample] * lease.n)


def raw_request(endpoint: str, frames: list[bytes], timeout_s: float = 10.0) -> Message | None:
    """Frames a codec never made, on a bare socket: the server's reply, None if none came."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(endpoint)
        socket.send_multipart(frames)
        if not socket.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        _envelope, *reply = socket.recv_multipart()
        return Decoder().decode(reply)
    finally:
        socket.close()


def push_raw(endpoint: str, frames: list[bytes]) -> None:
    socket = zmq.Context.instance().socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 1000)
    socket.connect(endpoint)
    socket.send_multipart(frames)
    socket.close()


def garbage_is_answered(endpoint: str, max_bytes: int) -> None:
    """Frames no codec made get an ErrorReply naming the fault; a frame over the server's
    limit gets no answer (ZeroMQ drops the connection)."""
    body = msgspec.msgpack.encode({"type": "Nonsense"})
    for frames in ([b"not a message"], [ENVELOPE.pack(7, 0), b"garbage"],
                   [ENVELOPE.pack(8, 0), PREAMBLE_FRAME, body],
                   [ENVELOPE.pack(9, 0), PREAMBLE_FRAME, b"\xc1"]):
        reply = raw_request(endpoint, frames)
        assert isinstance(reply, ErrorReply) and reply.code in WIRE_ERROR_KINDS, (frames, reply)
    assert raw_request(endpoint, [ENVELOPE.pack(10, 0), b"\0" * (2 * max_bytes)], 3.0) is None


def precondition(ok: bool, what: str) -> None:
    """A step a probe needs, not what it checks: fails the test saying so."""
    if not ok:
        pytest.fail(f"precondition failed: {what}", pytrace=False)


def wait_for_line(launcher, path: Path, pattern: str, timeout_s: float) -> None:
    """``pattern`` in ``path`` while the launcher runs (a precondition)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and launcher.poll() is None:
        if path.exists() and re.search(pattern, path.read_text(errors="replace")):
            return
        time.sleep(0.05)
    precondition(False, f"{pattern!r} in {path} (launcher exit code {launcher.poll()})")


@pytest.mark.slow
def test_a_hostile_peer_without_keys_is_refused_and_the_run_trains_on(
        random_model_dir: Path, run_root: Path) -> None:
    # 400 steps: the probes below need the learner and the buffer alive, and 100 steps of
    # the small model at eta = 2 ended in 6 s, before the weight server was probed
    launcher, run_dir, real_generator = started_run(random_model_dir, run_root, steps=400)
    ctx = load_run_dir(run_dir)
    generator, learner = Client(ctx.buffer_endpoint), Client(ctx.buffer_endpoint)
    metrics = Pusher(ctx.metrics_endpoint)
    try:
        assert generator.request(Heartbeat(generator_id="intruder", version=0), 10.0)
        refused(generator, LEARNER_MESSAGES, "forbidden")
        refused(generator, (Metrics(source="x", step=0, values={}),), "schema")

        refused(learner, (SampleRequest(num_groups=-1), SampleRequest(num_groups=1, step=10**9),
                          VersionUpdate(version=10**12, step=10**12)), "bad_request")
        refused(learner, GENERATOR_MESSAGES, "forbidden")  # it keeps the learner's role

        attach = generator.request(Attach(generator_id="intruder", engine="x", device="x"), 10.0)
        assert isinstance(attach, AttachAck) and attach.accepted
        lease = PromptLease(lease_id="")
        while not lease.lease_id:
            lease = generator.request(LeaseRequest(generator_id="intruder", max_prompts=1), 10.0)
        ack = generator.request(hostile_group(lease), 10.0)
        assert isinstance(ack, RolloutAck) and ack.verdict == "malformed", ack
        generator.request(Detach(generator_id="intruder", reason="done"), 10.0)
        # without keys nothing binds a name to a connection: the real generator is detached
        # (its leases back in the pool) and must attach again by itself
        generator.request(Detach(generator_id=real_generator, reason="hostile"), 10.0)

        with pytest.raises(PeerTimeout):  # over buffer.max_message_bytes: never answered
            Client(ctx.buffer_endpoint).request(
                Heartbeat(generator_id="x" * (2 * MAX_MESSAGE_BYTES), version=0), 3.0)
        garbage_is_answered(ctx.buffer_endpoint, MAX_MESSAGE_BYTES)
        wait_for(run_dir / "logs" / "learner.log", r"serving weight versions on", 120)
        garbage_is_answered(ctx.weights_endpoint, WEIGHT_SERVER_MAX_BYTES)

        nan = float("nan")
        metrics.send(Metrics(source="learner", step=0, values={"version": nan,
                                                               "rollout/reward_mean": nan}))
        metrics.send(Metrics(source="buffer", step=0, values={"buffer/generators": nan,
                                                              "buffer/occupancy": math.inf}))
        push_raw(ctx.metrics_endpoint, [b"garbage"])
        push_raw(ctx.metrics_endpoint, [PREAMBLE_FRAME, b"\xc1"])
    finally:
        generator.close()
        learner.close()
        metrics.close(linger_s=1.0)
    output, final = finish(launcher, run_dir)
    assert final.get("rejected/forbidden", 0) >= len(LEARNER_MESSAGES) + len(GENERATOR_MESSAGES)
    assert final.get("rejected/bad_request", 0) >= 3
    assert final.get("rejected/malformed", 0) >= 1
    assert last_metric(run_dir, "buffer/rejected/forbidden") >= len(LEARNER_MESSAGES)
    buffer_log = (run_dir / "logs" / "buffer.log").read_text()
    assert "refused Shutdown" in buffer_log and "refused Heartbeat" in buffer_log
    assert "rejected rollout hostile-1" in buffer_log
    assert f"generator {real_generator} detached (hostile)" in buffer_log
    assert len(re.findall(f"generator {real_generator} attached", buffer_log)) >= 2, buffer_log
    kinds = re.search(r"rejected requests by kind: (\{.*\})", buffer_log)
    assert kinds and {"envelope", "preamble", "schema"} <= set(ast.literal_eval(kinds.group(1))), kinds


def make_keys(keys_dir: Path) -> None:
    keys.make_keys(keys_dir)


@pytest.mark.slow
def test_a_generator_key_cannot_act_as_the_learner_and_no_key_gets_no_answer(
        random_model_dir: Path, run_root: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    make_keys(keys)
    launcher, run_dir, _ = started_run(random_model_dir, run_root,
                                       "topology.security.curve=true",
                                       f"topology.security.keys_dir={keys / 'control'}")
    ctx = load_run_dir(run_dir)
    held = keys / "generator"  # what a generator host holds
    generator_keys = ClientKeys(keypair=load_keypair(held / "client.key_secret"),
                                server_public_key=load_public_key(held / "server.key"))
    create_keypair(tmp_path / "stranger", "client")
    stranger_keys = ClientKeys(keypair=load_keypair(tmp_path / "stranger" / "client.key_secret"),
                               server_public_key=generator_keys.server_public_key)
    holder = Client(ctx.buffer_endpoint, keys=generator_keys)
    try:
        refused(holder, LEARNER_MESSAGES, "forbidden")
    finally:
        holder.close()
    for keys_held in (None, stranger_keys):
        outsider = Client(ctx.buffer_endpoint, keys=keys_held)
        try:
            with pytest.raises(PeerTimeout):
                outsider.request(Shutdown(reason="hostile"), 3.0)
        finally:
            outsider.close()
    _, final = finish(launcher, run_dir)
    assert final.get("rejected/forbidden", 0) >= len(LEARNER_MESSAGES)
    assert last_metric(run_dir, "buffer/rejected/forbidden") >= len(LEARNER_MESSAGES)
    assert "refused Shutdown" in (run_dir / "logs" / "buffer.log").read_text()


@pytest.mark.slow
def test_a_generator_killed_mid_lease_leaves_every_prompt_accounted_for(
        random_model_dir: Path, run_root: Path, tmp_path: Path) -> None:
    """test_failures' dead generator, with the accounting checked from the outside."""
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY)
    # 30 steps: training goes on well past the killed generator's lease expiry (4 s)
    args = [a for a in small_run_overrides(random_model_dir, run_root, steps=30)
            if not a.startswith("topology.")]
    args += ["rollout.response_length=32", "trainer.val_before_train=false",
             "trainer.test_freq=-1", "buffer.lease_timeout_s=4",
             "buffer.heartbeat_timeout_s=600", "buffer.max_staleness=2",
             "buffer.min_generators=2"]  # leasing begins once both are there
    launcher = start_launcher([str(topology), str(ROOT / "configs" / "arithmetic-grpo.toml"),
                               *args])
    try:
        run_dir = first_run_dir(run_root)
        # the first to get a lease dies holding it
        log, lease = wait_for_any([run_dir / "logs" / f"{name}.log" for name in ("gen0", "gen1")],
                                  r"lease (L\d+): (\d+) prompts", 120)
        os.killpg(pid_of(run_dir, "relay.generators.main", f"--name {log.stem}"), signal.SIGKILL)
        output, final = finish(launcher, run_dir)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert f"generator {log.stem} died" in output
    # it never answered the lease it logged: those prompts expired back into the pool
    assert final.get("prompts/expired", 0) >= int(lease.group(2)), final
    assert final["prompts/leased"] > final["prompts/expired"]
    assert final.get("groups/trained", 0) >= 30 * 4  # every step's batch: data.train_batch_size


@pytest.mark.slow
def test_a_learner_that_cannot_write_its_checkpoint_ends_the_run_naming_the_error(
        random_model_dir: Path, run_root: Path, tmp_path: Path) -> None:
    """A disk fault: the checkpoint folder lies under a regular file."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    launcher = start_launcher(run_args(random_model_dir, run_root, "trainer.save_freq=2",
                                       f"checkpoint.dir={blocker / 'checkpoints'}", steps=6))
    try:
        output, _ = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    precondition(launcher.returncode == 1 and processes_mentioning(str(run_root)) == [] and
                 "essential process learner (learner) died" in output, output)
    learner_log = next(run_root.glob("*/logs/learner.log")).read_text()
    cause = f"NotADirectoryError: [Errno 20] Not a directory: '{blocker / 'checkpoints'}'"
    precondition(cause in learner_log, f"{cause} in the learner's log")
    assert f"raising {cause}" in output, "the launcher's message does not name the error"


@pytest.mark.slow
def test_a_second_ctrl_c_while_the_run_stops_leaves_nothing_behind(
        random_model_dir: Path, run_root: Path) -> None:
    launcher = start_launcher(run_args(random_model_dir, run_root, steps=100_000))
    run_dir = first_run_dir(run_root)
    try:
        wait_for_line(launcher, run_dir / "logs" / "gen0.log", r"lease L\d+", 120)
        launcher.send_signal(signal.SIGINT)
        wait_for_line(launcher, run_dir / "logs" / "buffer.log", r"signal \d+: stopping", 60)
        launcher.send_signal(signal.SIGINT)  # an impatient operator
        output, _ = launcher.communicate(timeout=120)
        left_behind = processes_mentioning(str(run_dir))
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for line in processes_mentioning(str(run_dir)):  # what this test started, by pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
    assert left_behind == [], "\n".join([*left_behind, output])
    assert launcher.returncode == 130, output
    assert "interrupted" in output


@pytest.mark.slow
def test_a_spoofed_learner_step_on_the_metrics_address_does_not_end_the_run(
        random_model_dir: Path, run_root: Path) -> None:
    timeout_s = 60  # counted from the launch to the first step too: room for a slow start
    launcher = start_launcher(run_args(random_model_dir, run_root,
                                       f"trainer.progress_timeout_s={timeout_s}", steps=100_000))
    run_dir = first_run_dir(run_root)
    buffer_log = run_dir / "logs" / "buffer.log"
    try:
        wait_for_line(launcher, run_dir / "logs" / "gen0.log",
                      r"now generating with weights version [1-9]", 180)
        metrics = Pusher(load_run_dir(run_dir).metrics_endpoint)
        metrics.send(Metrics(source="learner", step=10**12, values={}))
        metrics.close(linger_s=1.0)
        stopping = lambda: re.search(r"signal \d+: stopping", buffer_log.read_text())  # noqa: E731
        deadline = time.monotonic() + timeout_s + 15  # the learner keeps stepping all along
        while time.monotonic() < deadline and launcher.poll() is None and not stopping():
            time.sleep(0.5)
        if launcher.poll() is None and not stopping():
            launcher.send_signal(signal.SIGINT)  # still training: the probe is over
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, output
    assert "no learner step" not in output
    assert processes_mentioning(str(run_dir)) == []


@pytest.mark.slow
def test_an_absurd_evaluation_report_does_not_kill_the_learner(
        random_model_dir: Path, run_root: Path) -> None:
    launcher, run_dir, _ = started_run(random_model_dir, run_root)
    try:
        wait_for_line(launcher, run_dir / "logs" / "learner.log",
                      r"serving weight versions on", 120)
        weights = Client(load_run_dir(run_dir).weights_endpoint)
        try:
            for report in (EvalReport(step=1, version=0, metrics={"eval/" + "x" * 300: 1.0}),
                           EvalReport(step=2**63, version=0, metrics={"eval/accuracy": 1.0})):
                reply = weights.request(EvalRequest(after_step=0, report=report), 10.0)
                precondition(isinstance(reply, WeightManifest), f"the weight server answered "
                                                                f"{reply!r}")
        finally:
            weights.close()
        finish(launcher, run_dir)
    finally:
        if launcher.poll() is None:
            launcher.kill()


ATTACH = ROOT / "tools" / "attach-generator.py"
TOLD_WITHIN_S = 10.0  # an attached generator leaves this soon after the run stopped


@pytest.mark.slow
def test_ctrl_c_tells_a_generator_attached_by_hand_that_the_run_is_over(
        random_model_dir: Path, run_root: Path) -> None:
    """Ctrl-C while a generator attached with ``tools/attach-generator.py`` works (the
    launcher does not own it): the buffer answers its next request with ``Shutdown`` before
    it exits, so the generator leaves within seconds, saying why, instead of retrying the
    vanished buffer for ``buffer.client_patience_s`` (300 s)."""
    launcher = start_launcher(run_args(random_model_dir, run_root, steps=100_000))
    run_dir = first_run_dir(run_root)
    attached = None
    try:
        wait_for_line(launcher, run_dir / "logs" / "gen0.log", r"lease L\d+", 120)
        attached = subprocess.Popen([sys.executable, str(ATTACH), str(run_dir), "--threads", "1"],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    cwd=ROOT)
        assert attached.stdout is not None
        first_line = attached.stdout.readline()
        name = re.search(r"starting (attached-\S+) on", first_line)
        precondition(name is not None, f"the attached generator's name in {first_line!r}")
        wait_for_line(launcher, run_dir / "logs" / f"{name.group(1)}.log", r"lease L\d+", 120)
        launcher.send_signal(signal.SIGINT)
        output, _ = launcher.communicate(timeout=120)
        run_stopped = time.monotonic()
        rest, _ = attached.communicate(timeout=120)
        left_after_s = time.monotonic() - run_stopped
    finally:
        for process in (attached, launcher):
            if process is not None and process.poll() is None:
                process.kill()
    assert launcher.returncode == 130, output
    assert attached.returncode == 0, first_line + rest
    assert left_after_s < TOLD_WITHIN_S, (left_after_s, rest)
    assert ("the buffer ended the run: the run was stopped: the buffer got a stop signal"
            in rest), rest
    assert "no reply from" not in rest, rest
    buffer_log = (run_dir / "logs" / "buffer.log").read_text()
    assert f"generator {name.group(1)} told that the run was stopped" in buffer_log
    assert processes_mentioning(str(run_dir)) == []


# -- issue 30's hostile cases ---------------------------------------------------------------

HOSTILE_MESSAGE_BYTES = 4 << 20  # buffer.max_message_bytes for the queueing probe
HOSTILE_CONNECTIONS = 2
HOSTILE_REQUESTS = 40  # per connection, each just under HOSTILE_MESSAGE_BYTES, never read
RSS_SLACK_MIB = 128
"""What the buffer's own work may add while it is probed (its groups, its log, Python's
arenas). The bound (``relay.buffer.main``, Memory): each connection queues at most REQUEST_HWM (16)
requests plus the one being read and the one being answered, so peers' frames hold at most
(16 + 2) x buffer.max_message_bytes per connection."""
RSS_BOUND_MIB = HOSTILE_CONNECTIONS * 18 * (HOSTILE_MESSAGE_BYTES >> 20) + RSS_SLACK_MIB


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """``field`` of ``/proc/<pid>/status`` in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1)) / 1024


def flood(endpoint: str, connections: int, requests: int, size: int) -> None:
    """``connections`` peers each send ``requests`` heartbeats of about ``size`` bytes as
    fast as the socket takes them, reading no reply, then leave."""
    sockets = []
    try:
        for _ in range(connections):
            socket = zmq.Context.instance().socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, requests + 1)
            socket.connect(endpoint)
            sockets.append(socket)
        body = msgspec.msgpack.encode(Heartbeat(generator_id="f" * (size - 64), version=0))
        for request_id in range(requests):
            for socket in sockets:
                socket.send_multipart([ENVELOPE.pack(request_id, 0), PREAMBLE_FRAME, body])
        time.sleep(2.0)  # let the buffer work through what it queued
    finally:
        for socket in sockets:
            socket.close()


def tensor_bomb(max_bytes: int) -> bytes:
    """A rollout group whose metadata holds as many one-byte tensors as fit under
    ``max_bytes`` (each costs a receiver ~0.5 KiB and ~4 us when built)."""
    one_byte = msgspec.msgpack.Ext(1, msgspec.msgpack.encode(["uint8", [1], b"\x07"]))
    count = (max_bytes - 1024) // len(msgspec.msgpack.encode(one_byte))
    return msgspec.msgpack.encode(RolloutGroup(
        rollout_id="bomb", lease_id="l", prompt_id="p", generator_id="intruder", samples=[],
        metadata={"bomb": [one_byte] * count}))


def huge_reward_group(lease: PromptLease) -> RolloutGroup:
    """An honest-looking group whose reward float32 cannot hold (1e39)."""
    sample = Sample(prompt_ids=torch.tensor([1, 2], dtype=torch.int32),
                    response_ids=torch.tensor([3, 4], dtype=torch.int32),
                    logprobs=torch.zeros(2), versions=torch.zeros(2, dtype=torch.int32),
                    reward=1e39)
    return RolloutGroup(rollout_id="hostile-huge", lease_id=lease.lease_id,
                        prompt_id=lease.prompts[0].prompt_id, generator_id="intruder",
                        samples=[sample] * lease.n)


@pytest.mark.slow
def test_hostile_payloads_are_refused_and_the_buffers_memory_stays_bounded(
        random_model_dir: Path, run_root: Path) -> None:
    """Oversize queueing, a tensor bomb, NaN priorities and a 1e39 reward against a live
    keyless run: each refused, the run trains on, and the buffer's resident memory stays
    within RSS_BOUND_MIB of what it held before the probes, sampled throughout."""
    launcher, run_dir, _ = started_run(random_model_dir, run_root,
                                       f"buffer.max_message_bytes={HOSTILE_MESSAGE_BYTES}",
                                       steps=400)
    ctx = load_run_dir(run_dir)
    buffer_pid = pid_of(run_dir, "relay.buffer.main")
    wait_for_line(launcher, run_dir / "logs" / "learner.log", r"serving weight versions on", 120)
    before = rss_mib(buffer_pid)
    Path(f"/proc/{buffer_pid}/clear_refs").write_text("5")  # VmHWM from here
    generator, learner = Client(ctx.buffer_endpoint), Client(ctx.buffer_endpoint)
    try:
        flood(ctx.buffer_endpoint, HOSTILE_CONNECTIONS, HOSTILE_REQUESTS,
              HOSTILE_MESSAGE_BYTES - 4096)
        began = time.monotonic()
        reply = raw_request(ctx.buffer_endpoint, [ENVELOPE.pack(1, 0), PREAMBLE_FRAME,
                                                  tensor_bomb(HOSTILE_MESSAGE_BYTES)], 30.0)
        assert isinstance(reply, ErrorReply) and reply.code == "tensor", reply
        assert time.monotonic() - began < 10.0

        nan_priorities = SampleRequest(num_groups=4, priorities={"g": float("nan"),
                                                                 "h": 1.0})
        refused(learner, (nan_priorities,), "bad_priorities")

        attach = generator.request(Attach(generator_id="intruder", engine="x", device="x"), 10.0)
        precondition(isinstance(attach, AttachAck) and attach.accepted, f"attached: {attach}")
        lease = PromptLease(lease_id="")
        while not lease.lease_id:
            lease = generator.request(LeaseRequest(generator_id="intruder", max_prompts=1), 10.0)
        ack = generator.request(huge_reward_group(lease), 10.0)
        assert isinstance(ack, RolloutAck) and ack.verdict == "malformed", ack
        generator.request(Detach(generator_id="intruder", reason="done"), 10.0)
        peak = rss_mib(buffer_pid, "VmHWM")
    finally:
        generator.close()
        learner.close()
    assert peak - before < RSS_BOUND_MIB, (before, peak)
    _, final = finish(launcher, run_dir)
    assert final.get("requests/bad_priorities", 0) >= 1
    assert final.get("rejected/malformed", 0) >= 1
    buffer_log = (run_dir / "logs" / "buffer.log").read_text()
    assert "rejected rollout hostile-huge" in buffer_log
    assert "float32" in buffer_log
    assert "refused the learner's priorities" in buffer_log


@pytest.mark.slow
def test_forged_evaluation_requests_and_metrics_are_refused_under_curve(
        random_model_dir: Path, run_root: Path, tmp_path: Path) -> None:
    """A generator key asks the weight server to skip every evaluation and claims the
    learner's last step on the metrics address: both refused, the run ends normally."""
    keys = tmp_path / "keys"
    make_keys(keys)
    launcher, run_dir, _ = started_run(random_model_dir, run_root,
                                       "topology.security.curve=true",
                                       f"topology.security.keys_dir={keys / 'control'}",
                                       steps=200)
    ctx = load_run_dir(run_dir)
    held = keys / "generator"
    generator_keys = ClientKeys(keypair=load_keypair(held / "client.key_secret"),
                                server_public_key=load_public_key(held / "server.key"))
    wait_for_line(launcher, run_dir / "logs" / "learner.log", r"serving weight versions on", 120)
    weights = Client(ctx.weights_endpoint, keys=generator_keys)
    metrics = Pusher(ctx.metrics_endpoint, keys=generator_keys)
    try:
        refused(weights, (EvalRequest(after_step=10**9),), "forbidden")
        metrics.send(Metrics(source="learner", step=200, values={}))
    finally:
        weights.close()
        metrics.close(linger_s=1.0)
    output, _ = finish(launcher, run_dir)
    assert "ignored metrics claiming to come from the 'learner'" in output, output
    assert "refused an EvalRequest" in (run_dir / "logs" / "learner.log").read_text()


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_branch_keeps_a_later_checkpoint_and_a_damaged_newest_one_is_skipped(
        random_model_dir: Path, run_root: Path, tmp_path: Path) -> None:
    """Three runs in one checkpoint folder: run a saves step-4 and step-6; a branch from
    step-4 saves step-5 and must not delete run a's step-6 (another lineage); with step-5,
    the newest written, damaged, an auto resume skips it, says why, and goes on from the
    newest valid one, step-6."""
    folder = tmp_path / "checkpoints"

    def run(*extra: str, steps: int) -> subprocess.CompletedProcess:
        root = tmp_path / f"runs-{len(list(tmp_path.glob('runs-*')))}"
        result = launch(run_args(random_model_dir, root, f"checkpoint.dir={folder}", *extra,
                                 steps=steps), timeout_s=600)
        assert result.returncode == 0, result.stdout + result.stderr
        return result

    run("trainer.save_freq=2", steps=6)
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-4", "step-6"]
    run("trainer.resume_mode=resume_path", f"trainer.resume_from_path={folder / 'step-4'}",
        "trainer.save_freq=5", "checkpoint.keep_last=1", steps=5)
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-4", "step-5", "step-6"]

    damaged = folder / "step-5" / "buffer.rec"
    flip_a_byte(damaged)
    resumed = run("trainer.resume_mode=auto", "trainer.save_freq=-1", steps=8)
    said = resumed.stdout + resumed.stderr
    assert f"skipping {folder / 'step-5'}: {damaged}: its SHA-256 differs" in said, said
    assert f"resuming from {folder / 'step-6'}, the newest valid checkpoint" in said, said
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-4", "step-5", "step-6"]
