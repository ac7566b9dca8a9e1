"""Publishing weight versions to K subscribers, beside a raw ZeroMQ copy of the same bytes.

    tools/with-venv python tools/bench-publish.py [--ranks 2] [--subscribers 2] \\
        [--bucket-mb 128] [--repeats 3] [--dtype bfloat16] [--model PATH | --shape NAME] \\
        [--receiver-copy DEVICE] [--lora-rank R]

``--ranks`` learner ranks (``torchrun``, gloo, CPU) load the model sharded with FSDP2 as the
learner does (``relay.learner.model.load_sharded``; default model: the cached random Qwen2.5-0.5B
architecture of ``tools/bench_model.py``, built on first use), and ``--subscribers`` plain
processes (this script, ``--subscriber``) subscribe to rank 0. Each repeat runs, one after
the other so that noise hits both:

a. Relay: every rank calls ``relay.learner.weights.publish_weights`` (rank 0 streaming on a
   ``WeightStream`` bound to a free loopback port); each subscriber builds the version with
   ``relay.generators.weight_receiver.VersionAssembler`` and reports (ZeroMQ PUSH to rank 0) the
   moment it is complete. Time: from the start of the publish until the last subscriber
   has the whole version.
b. raw: rank 0 sends the same bytes in the same bucket sizes through a plain pyzmq PUB
   socket (zero-copy sends of one pre-made buffer, all queued at once: no gathering, no
   per-bucket wait); the subscribers count the bytes. Time: until the last subscriber has
   counted them all. ``--raw-frames``: each bucket as one message of the frames Relay
   sends (one per parameter piece, ``pieces``), and/or as one frame (``bucket``).

Every rank samples its resident memory (``/proc/self/statm``, the counter behind VmRSS)
every ``--sample-ms`` during the publish; the peak extra is that peak minus the resident
memory just before the publish, in MiB and in buckets of ``--bucket-mb``. A warm-up round
(publish and raw copies, not counted) comes first, so first-touch allocations are excluded.
Freed memory that the allocator keeps (glibc keeps pieces under its dynamic mmap threshold,
at most 32 MiB, in its heap) is then already resident before each publish and not counted
as extra; the per-rank lines also give the highest peak over the resident memory before
the warm-up, which counts it (``MALLOC_MMAP_THRESHOLD_=1048576`` in the environment makes
glibc return it, at the price of first-touching every bucket again).

Each subscriber samples its own resident memory the same way from a version's manifest
until the version is whole: assembled whole in host memory (``HostVersion``, as the CPU
engines and the evaluator do), or with ``--receiver-copy DEVICE`` into a second copy of
the weights on DEVICE (``DeviceCopy``, as a CUDA engine's receiver does; ``meta`` stands
for a device whose memory is not the host's, so what remains is the receiver's host side).
Its peak over its resident memory before the first version is the figure to read: the
frames of a version it dropped stay with glibc as the ranks' buckets do (see above).

Rank 0 also splits its publish time into gather (the time outside ``Publisher.send``:
gathering buckets from the ranks), send (inside ``Publisher.send``: encoding, queueing and
waiting until ZeroMQ has written the bucket to every subscriber) and the tail after
``publish_weights`` returned until the last subscriber had the version (it can be slightly
negative: ZeroMQ's note that a bucket was written may reach rank 0 after a subscriber's
report). The table shows medians over ``--repeats``; GB/s is bytes of one version per
second (each subscriber receives all of them).

``--lora-rank R``: the whole benchmark runs three times, the model as it is, then with LoRA
adapters of rank R on every linear module (``model.lora_rank``, ``relay.learner.lora``)
published as the engines that take full weights get it, merged (the same bytes: each
adapted tensor W + (alpha / r) B A is computed from the rank's rows when its bucket is
gathered), then as vLLM's LoRA support gets it, the adapters alone
(``relay.configs.lora_publish``). The last lines give each LoRA publish's median time over
the full one's, and rank 0's gather time (where the merge runs) over the full one's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SHAPE = "qwen2.5-0.5b-arch"
MiB = 1 << 20


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model folder (default: the cached random --shape, "
                                        "built on first use)")
    parser.add_argument("--shape", default=SHAPE,
                        help=f"tools/bench_model.py shape when --model is not given ({SHAPE})")
    parser.add_argument("--ranks", type=int, default=2, help="learner ranks under torchrun")
    parser.add_argument("--subscribers", type=int, default=2, help="subscriber processes")
    parser.add_argument("--bucket-mb", type=float, default=128,
                        help="bucket size in MiB (rollout.update_weights_bucket_megabytes)")
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds")
    parser.add_argument("--dtype", default="bfloat16", help="publish dtype")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--raw-frames", default="pieces,bucket",
                        help="the raw copies to run, comma-separated: 'pieces' sends each "
                             "bucket as one message of one frame per parameter piece (the "
                             "frames Relay sends), 'bucket' as one frame of the bucket's size")
    parser.add_argument("--sample-ms", type=float, default=2.0,
                        help="resident memory sampling interval during a publish")
    parser.add_argument("--receiver-copy", metavar="DEVICE",
                        help="the subscribers assemble each version into a second copy of the "
                             "weights on DEVICE (relay.generators.weight_receiver.DeviceCopy, as a "
                             "CUDA generator does; 'meta' stands for a device whose memory "
                             "is not the host's) instead of whole in host memory")
    parser.add_argument("--lora-rank", type=int, default=0, metavar="R",
                        help="also publish the model with LoRA adapters of rank R "
                             "(model.lora_rank: merged weights, relay.learner.lora) in a "
                             "second run, and print its publish time over the full one's")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds any one wait may take (loading, one round, ...)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # torchrun's entry: a JSON file
    parser.add_argument("--subscriber", help=argparse.SUPPRESS)  # a subscriber: a JSON file
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.subscribers < 1 or args.repeats < 1 or args.threads < 1:
        parser.error("--ranks, --subscribers, --repeats and --threads must be 1 or more")
    layouts = args.raw_frames.split(",")
    if not layouts or set(layouts) - {"pieces", "bucket"} or len(set(layouts)) < len(layouts):
        parser.error("--raw-frames: a comma-separated selection of 'pieces' and 'bucket'")
    if args.bucket_mb <= 0 or args.sample_ms <= 0 or args.timeout <= 0:
        parser.error("--bucket-mb, --sample-ms and --timeout must be positive")
    return args


# ---------------------------------------------------------------------------------------
# Memory (a local copy of tools/bench-learner.py's sampler, at a few ms)
# ---------------------------------------------------------------------------------------

_PAGE = os.sysconf("SC_PAGE_SIZE")


class Resident:
    """This process's resident memory in bytes: /proc/self/statm's second field, the same
    counter as VmRSS in /proc/self/status, read through a kept-open file (cheap)."""

    def __init__(self) -> None:
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)

    def __call__(self) -> int:
        return int(os.pread(self._fd, 256, 0).split()[1]) * _PAGE


class PeakSampler:
    """The largest resident memory seen between enter and exit, sampled every
    ``interval_s``, and the resident memory just before (``before``)."""

    def __init__(self, resident: Resident, interval_s: float) -> None:
        self._resident, self._interval = resident, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.before = self.peak = 0
        self.samples = 0

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._resident())
            self.samples += 1

    def __enter__(self) -> PeakSampler:
        self.before = self.peak = self._resident()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._resident())

    @property
    def extra(self) -> int:
        return self.peak - self.before


# ---------------------------------------------------------------------------------------
# Learner ranks
# ---------------------------------------------------------------------------------------


def bucket_pieces(plan) -> list[list[int]]:
    """Bytes of each piece of each of ``plan``'s buckets."""
    import math

    import torch

    shapes = {e.name: (e.shape, getattr(torch, e.dtype).itemsize) for e in plan.entries}
    return [[(piece.stop - piece.start) * shapes[piece.name][1]
             * math.prod(shapes[piece.name][0][1:]) for piece in pieces]
            for pieces in plan.buckets]


class SendTimer:
    """Seconds rank 0 spends in its stream's ``Publisher.send`` (encode, queue, wait until
    written to every subscriber), by wrapping that one bound method of this instance;
    ``available`` is False when the stream has no such publisher any more."""

    def __init__(self, stream) -> None:
        self.seconds = 0.0
        self.calls = 0
        publisher = getattr(stream, "_publisher", None)
        self.available = publisher is not None and callable(getattr(publisher, "send", None))
        if not self.available:
            return
        send = publisher.send

        def timed(*args, **kwargs):
            began = time.monotonic()
            try:
                return send(*args, **kwargs)
            finally:
                self.seconds += time.monotonic() - began
                self.calls += 1

        publisher.send = timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


class Hub:
    """Rank 0's sockets: the Relay stream, the raw PUB and the PULL the subscribers report
    to."""

    def __init__(self, subscribers: int, timeout_s: float) -> None:
        import zmq

        from relay.learner.weights import WeightStream

        self.k, self.timeout_s = subscribers, timeout_s
        self.stream = WeightStream("tcp://127.0.0.1:*")
        self.timer = SendTimer(self.stream)
        context = zmq.Context.instance()
        self.raw = context.socket(zmq.PUB)
        self.raw.linger = 0
        self.raw.sndhwm = 0  # never drop: the queues hold references to one buffer
        self.raw.bind("tcp://127.0.0.1:*")
        self.reports = context.socket(zmq.PULL)
        self.reports.linger = 0
        self.reports.bind("tcp://127.0.0.1:*")
        self.endpoints = {"relay": self.stream.endpoint,
                          "raw": self.raw.getsockopt_string(zmq.LAST_ENDPOINT),
                          "reports": self.reports.getsockopt_string(zmq.LAST_ENDPOINT)}
        self._backlog: list[dict] = []
        self.buffer = None

    def prepare(self, largest: int) -> None:
        """The raw copy's one buffer, made (and touched) before anything is measured."""
        import numpy as np

        self.buffer = np.random.default_rng(0).integers(0, 255, largest, dtype=np.uint8)

    def control(self, **message) -> None:
        """A raw-stream control message: one frame, b"C" + JSON (data: b"D", then frames)."""
        self.raw.send(b"C" + json.dumps(message).encode())

    def next_report(self, deadline: float, what: str) -> dict:
        left = deadline - time.monotonic()
        if left <= 0 or not self.reports.poll(int(left * 1000)):
            raise TimeoutError(f"timed out waiting for {what}")
        report = self.reports.recv_json()
        if report.get("kind") == "error":
            raise RuntimeError(f"subscriber {report.get('index')} failed: {report.get('detail')}")
        return report

    def wait(self, kind: str, key: int, what: str) -> list[dict]:
        """The ``k`` subscribers' reports of ``kind`` for round ``key``."""
        deadline = time.monotonic() + self.timeout_s
        got = [r for r in self._backlog if r["kind"] == kind and r["key"] == key]
        self._backlog = [r for r in self._backlog if r not in got]
        while len({r["index"] for r in got}) < self.k:
            report = self.next_report(deadline, f"{what} ({len(got)} of {self.k} subscribers "
                                                f"reported within {self.timeout_s:g} s)")
            if report["kind"] == kind and report["key"] == key:
                got.append(report)
            elif report["kind"] != "hello":
                self._backlog.append(report)
        return got

    def handshake(self) -> None:
        """Ping both streams until every subscriber heard each (PUB drops what goes out
        before a subscription arrived)."""
        from relay.transport.messages import EvalOffer

        deadline = time.monotonic() + self.timeout_s
        heard: set[tuple[int, str]] = set()
        while len(heard) < 2 * self.k:
            self.stream.offer(EvalOffer(step=0, version=0))
            self.control(op="ping")
            pause = time.monotonic() + 0.1
            while time.monotonic() < pause:
                try:
                    report = self.next_report(min(pause, deadline), "")
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"only {len(heard)} of {2 * self.k} subscriptions "
                                           f"answered within {self.timeout_s:g} s") from None
                    break
                if report["kind"] == "hello":
                    heard.add((report["index"], report["key"]))
        self.timer.reset()

    def raw_round(self, key: str, buckets: list[list[int]]) -> dict:
        """Send each bucket as one message of frames of the sizes given, zero-copy from the
        one pre-made buffer, without waiting; the seconds until the last subscriber counted
        every byte."""
        view = memoryview(self.buffer)
        began = time.monotonic()
        self.control(op="round", key=key, total=sum(map(sum, buckets)))
        for frames in buckets:
            self.raw.send_multipart([b"D", *(view[:size] for size in frames)], copy=False)
        queued = time.monotonic()
        reports = self.wait("raw", key, f"the raw copy {key}")
        return {"seconds": max(r["t"] for r in reports) - began, "queued_s": queued - began,
                "bytes": [r["bytes"] for r in reports]}

    def close(self) -> None:
        try:
            self.control(op="stop")
        finally:
            self.stream.close()
            self.raw.close()
            self.reports.close()


def worker(spec_file: str) -> None:
    """One rank (started by torchrun): load, shard, publish rounds, write measurements."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    from relay.learner.model import load_sharded
    from relay.learner.weight_buckets import plan_buckets
    from relay.learner.weights import publish_weights

    spec = json.loads(Path(spec_file).read_text())
    args = argparse.Namespace(**spec["args"])
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    # Longer than rank 0's own waits, so that rank 0 names what went wrong first.
    dist.init_process_group("gloo", timeout=timedelta(seconds=2 * args.timeout + 60))
    rank = dist.get_rank()
    hub = None
    resident = Resident()
    try:
        dtype = getattr(torch, args.dtype)
        began = time.monotonic()
        lora = None
        if args.lora_rank > 0:
            from relay.configs.run_schema import ModelConfig
            lora = ModelConfig(path=spec["model"], lora_rank=args.lora_rank)
        model = load_sharded(spec["model"], compute_dtype=torch.bfloat16,
                             device=torch.device("cpu"), lora=lora)
        plan = plan_buckets(model, dtype, int(args.bucket_mb * MiB),
                            adapters=getattr(args, "lora_adapters", False))
        pieces = bucket_pieces(plan)
        sizes = [sum(bucket) for bucket in pieces]
        assert sum(sizes) == plan.total_bytes, (sum(sizes), plan.total_bytes)
        layouts = {"pieces": pieces, "bucket": [[size] for size in sizes]}
        if rank == 0:
            print(f"loaded and sharded in {time.monotonic() - began:.1f} s: "
                  f"{plan.total_bytes / 1e6:.1f} MB in {len(sizes)} bucket(s) of up to "
                  f"{max(sizes) / MiB:.1f} MiB", flush=True)
            hub = Hub(args.subscribers, args.timeout)
            hub.prepare(max(sizes))
            endpoints = Path(spec["endpoints"])
            endpoints.with_suffix(".tmp").write_text(json.dumps(hub.endpoints))
            endpoints.with_suffix(".tmp").rename(endpoints)
            hub.handshake()
            print(f"{args.subscribers} subscriber(s) connected", flush=True)
        dist.barrier()
        rounds = []
        for round_ in range(args.repeats + 1):  # round 0: the warm-up
            version = round_ + 1
            gc.collect()
            dist.barrier()
            with PeakSampler(resident, args.sample_ms / 1000) as sampler:
                started = time.monotonic()
                publish_weights(model, plan, dtype, version=version, step=version,
                                stream=hub.stream if hub else None)
                returned = time.monotonic()
            row = {"round": round_, "extra": sampler.extra, "before": sampler.before,
                   "peak": sampler.peak, "samples": sampler.samples,
                   "returned_s": returned - started}
            if hub is not None:
                reports = hub.wait("relay", version, f"version {version}")
                bad = [r for r in reports if r["bytes"] != plan.total_bytes]
                if bad:
                    raise RuntimeError(f"version {version}: a subscriber assembled "
                                       f"{bad[0]['bytes']} bytes, expected {plan.total_bytes}")
                row["publish_s"] = max(r["t"] for r in reports) - started
                row["receivers"] = {r["index"]: (r["rss_extra"], r["rss_over_start"])
                                    for r in reports}
                row["send_s"] = hub.timer.seconds if hub.timer.available else None
                row["send_calls"] = hub.timer.calls
                hub.timer.reset()
            dist.barrier()
            if hub is not None:
                row["raw"] = {}
                for layout in args.raw_frames.split(","):
                    key = f"{layout}:{version}"
                    raw = hub.raw_round(key, layouts[layout])
                    if any(b != plan.total_bytes for b in raw["bytes"]):
                        raise RuntimeError(f"raw copy {key}: subscribers counted "
                                           f"{raw['bytes']} bytes, expected {plan.total_bytes}")
                    row["raw"][layout] = raw
                raws = ", ".join(f"raw ({layout}) {raw['seconds']:.2f} s"
                                 for layout, raw in row["raw"].items())
                print(f"  {'warm-up' if round_ == 0 else f'repeat {round_}'}: publish "
                      f"{row['publish_s']:.2f} s, {raws}", flush=True)
            rounds.append(row)
        result = {"rank": rank, "rounds": rounds, "total_bytes": plan.total_bytes,
                  "buckets": len(sizes), "largest_bucket": max(sizes)}
        Path(spec["out"]).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    except Exception as exc:
        Path(spec["out"]).with_suffix(f".rank{rank}.error").write_text(
            f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if hub is not None:
            hub.close()
        dist.destroy_process_group()
    # Skip interpreter teardown: a finished gloo rank sometimes aborts in it (see
    # tests/conftest.py exit_worker), failing a run whose work was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------
# Subscribers
# ---------------------------------------------------------------------------------------


def subscriber(spec_file: str, index: int) -> None:
    """One subscriber: assemble every Relay version, count every raw round, report each
    to rank 0; ends on rank 0's ``stop``, when its parent goes, or on a signal."""
    import torch
    import zmq

    spec = json.loads(Path(spec_file).read_text())
    args = argparse.Namespace(**spec["args"])
    torch.set_num_threads(args.threads)
    endpoints = json.loads(Path(spec["endpoints"]).read_text())
    stop = threading.Event()
    parent = os.getppid()
    context = zmq.Context.instance()

    def reporter() -> zmq.Socket:
        push = context.socket(zmq.PUSH)
        push.linger = 1000
        push.connect(endpoints["reports"])
        return push

    def guarded(body):
        def run() -> None:
            push = reporter()
            try:
                body(push)
            except BaseException as exc:  # tell rank 0, then end the process
                push.send_json({"kind": "error", "index": index,
                                "detail": f"{type(exc).__name__}: {exc}"})
                stop.set()
                raise
            finally:
                push.close()
        return run

    @guarded
    def relay(push: zmq.Socket) -> None:
        from relay.generators.weight_receiver import DeviceCopy, VersionAssembler
        from relay.transport.messages import WeightBucket, WeightManifest
        from relay.transport.sockets import Subscriber

        stream = Subscriber(endpoints["relay"])
        copy = DeviceCopy(torch.device(args.receiver_copy)) if args.receiver_copy else None
        assembler = VersionAssembler(copy)
        resident = Resident()
        at_start = resident()  # before the first version
        sampler: PeakSampler | None = None  # from a version's manifest to its last bucket
        heard = False
        try:
            while not stop.is_set():
                msg = stream.receive(timeout_s=0.2)
                if msg is None:
                    continue
                if not heard:
                    push.send_json({"kind": "hello", "index": index, "key": "relay"})
                    heard = True
                if not isinstance(msg, WeightManifest | WeightBucket):
                    continue  # the handshake's pings
                if isinstance(msg, WeightManifest):
                    sampler = PeakSampler(resident, args.sample_ms / 1000).__enter__()
                staged = assembler.feed(msg)  # IncompleteVersion: reported as an error
                if staged is None:
                    continue
                done = time.monotonic()
                sampler.__exit__()
                nbytes = sum(t.numel() * t.element_size() for t in staged.tensors.values())
                push.send_json({"kind": "relay", "index": index, "key": staged.version,
                                "t": done, "bytes": nbytes, "rss_extra": sampler.extra,
                                "rss_over_start": sampler.peak - at_start})
                del staged
        finally:
            stream.close()

    @guarded
    def raw(push: zmq.Socket) -> None:
        sock = context.socket(zmq.SUB)
        sock.linger = 0
        sock.rcvhwm = 8  # as relay.transport.sockets.Subscriber
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoints["raw"])
        heard = False
        key, total, count = None, 0, 0
        try:
            while not stop.is_set():
                if not sock.poll(200):
                    continue
                frames = sock.recv_multipart(copy=False)
                if not heard:
                    push.send_json({"kind": "hello", "index": index, "key": "raw"})
                    heard = True
                head = frames[0].bytes
                if head[:1] == b"C":  # control: b"C" + JSON
                    message = json.loads(head[1:])
                    if message["op"] == "round":
                        key, total, count = message["key"], message["total"], 0
                    elif message["op"] == "stop":
                        stop.set()
                    continue
                if key is None:
                    raise RuntimeError("raw bytes before a round began")
                count += sum(len(frame) for frame in frames[1:])
                del frames
                if count >= total:
                    push.send_json({"kind": "raw", "index": index, "key": key,
                                    "t": time.monotonic(), "bytes": count})
                    key = None
        finally:
            sock.close()

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threads = [threading.Thread(target=relay, daemon=True),
               threading.Thread(target=raw, daemon=True)]
    for thread in threads:
        thread.start()
    while not stop.wait(0.5):
        if os.getppid() != parent or not all(t.is_alive() for t in threads):
            stop.set()
    for thread in threads:
        thread.join(5)
    sys.exit(0 if all(not t.is_alive() for t in threads) else 1)


# ---------------------------------------------------------------------------------------
# The coordinator
# ---------------------------------------------------------------------------------------


class Failure(RuntimeError):
    pass


def end(process: subprocess.Popen, group: bool, grace_s: float = 10.0) -> None:
    """Stop ``process`` (and its process group when ``group``) if it still runs: SIGTERM,
    then SIGKILL after ``grace_s``."""
    if process.poll() is not None and not group:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            if group:
                os.killpg(process.pid, sig)
            elif process.poll() is None:
                process.send_signal(sig)
            else:
                return
        except ProcessLookupError:
            return
        try:
            process.wait(wait_s)
            if not group:
                return
            time.sleep(0.2)  # torchrun ends its ranks; give stragglers a moment
            os.killpg(process.pid, 0)  # anyone left in the group?
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def run(args: argparse.Namespace, model: Path, folder: Path) -> list[dict]:
    """Start the ranks and the subscribers; the ranks' measurements."""
    spec = {"args": {k: v for k, v in vars(args).items()
                     if k not in ("worker", "subscriber", "index")},
            "model": str(model), "out": str(folder / "result"),
            "endpoints": str(folder / "endpoints.json")}
    spec_file = folder / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    script = str(Path(__file__).resolve())
    ranks = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={args.ranks}", script, "--worker", str(spec_file)],
        env=env, start_new_session=True)
    subscribers: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + args.timeout
        while not Path(spec["endpoints"]).is_file():
            if ranks.poll() is not None:
                raise Failure(f"the learner ranks exited (rc {ranks.returncode}) before "
                              "binding their sockets")
            if time.monotonic() > deadline:
                raise Failure(f"the learner ranks did not load the model within "
                              f"{args.timeout:g} s")
            time.sleep(0.2)
        subscribers = [subprocess.Popen([sys.executable, script, "--subscriber", str(spec_file),
                                         "--index", str(k)], env=env)
                       for k in range(args.subscribers)]
        phases = 1 + len(args.raw_frames.split(","))
        rounds = phases * (args.repeats + 1) + 3  # a timeout each: handshake, rounds, ending
        deadline = time.monotonic() + rounds * args.timeout
        while ranks.poll() is None:
            for k, sub in enumerate(subscribers):
                if sub.poll() not in (None, 0):  # 0: rank 0 told it to stop
                    raise Failure(f"subscriber {k} died (rc {sub.returncode}) while the ranks "
                                  "were publishing")
            if time.monotonic() > deadline:
                raise Failure(f"the run did not finish within {rounds * args.timeout:g} s")
            time.sleep(0.2)
        if ranks.returncode != 0:
            errors = [f"rank {r}: {path.read_text()}" for r in range(args.ranks)
                      if (path := Path(spec["out"]).with_suffix(f".rank{r}.error")).is_file()]
            raise Failure(f"the learner ranks failed (torchrun rc {ranks.returncode}): "
                          + ("; ".join(errors) or "see their output above"))
        return [json.loads(Path(spec["out"]).with_suffix(f".rank{r}.json").read_text())
                for r in range(args.ranks)]
    finally:
        for sub in subscribers:
            end(sub, group=False, grace_s=5.0)
        end(ranks, group=True)


def median(values: list[float]) -> float:
    return statistics.median(values)


LAYOUTS = {"pieces": "raw ZeroMQ, Relay's frames", "bucket": "raw ZeroMQ, 1 frame a bucket"}


def report(args: argparse.Namespace, model: Path, ranks: list[dict]) -> None:
    total = ranks[0]["total_bytes"]
    bucket = int(args.bucket_mb * MiB)
    measured = [r for r in ranks[0]["rounds"] if r["round"] > 0]
    layouts = list(measured[0]["raw"])
    print(f"\n{model}: {total / 1e6:.1f} MB of {args.dtype} in {ranks[0]['buckets']} "
          f"bucket(s) of <= {args.bucket_mb:g} MiB (largest "
          f"{ranks[0]['largest_bucket'] / MiB:.1f} MiB); {args.ranks} rank(s), "
          f"{args.subscribers} subscriber(s), {args.threads} torch thread(s) a process, "
          f"{os.cpu_count()} CPU(s)")
    print("\nper repeat, rank 0, seconds: publish = gather + Publisher.send + tail (the last "
          "subscriber finishing after the last bucket was written); raw copies")
    for r in measured:
        send = r["send_s"]
        split = (f" = {r['returned_s'] - send:.3g} + {send:.3g} + "
                 f"{r['publish_s'] - r['returned_s']:.3g}") if send is not None else ""
        raws = "; ".join(f"raw {layout} {raw['seconds']:.3g}" for layout, raw in r["raw"].items())
        print(f"  repeat {r['round']}: publish {r['publish_s']:.3g}{split}; {raws}")
    publish_s = median([r["publish_s"] for r in measured])
    publish_gbs = total / publish_s / 1e9
    memory = []
    for rank in ranks:
        extra = median([r["extra"] for r in rank["rounds"] if r["round"] > 0])
        memory.append(f"r{rank['rank']} {extra / MiB:.0f} MiB = {extra / bucket:.2f} b")
    timed = all(r["send_s"] is not None for r in measured)
    send = f"{median([r['send_s'] for r in measured]):.3g}" if timed else "n/a"
    gather = (f"{median([r['returned_s'] - r['send_s'] for r in measured]):.3g}"
              if timed else "n/a")
    print("\nmedians over repeats (GB/s: bytes of one version a second, which every "
          f"subscriber receives; b: buckets of {args.bucket_mb:g} MiB)")
    print("| total bytes | publish s | publish GB/s | baseline | raw s | raw GB/s | "
          "publish/raw | rank 0 gather s | rank 0 send s | peak extra memory per rank |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for layout in layouts:
        raw_s = median([r["raw"][layout]["seconds"] for r in measured])
        raw_gbs = total / raw_s / 1e9
        print(f"| {total:,} | {publish_s:.3g} | {publish_gbs:.3g} | {LAYOUTS[layout]} | "
              f"{raw_s:.3g} | {raw_gbs:.3g} | {publish_gbs / raw_gbs:.2f} | {gather} | "
              f"{send} | {'; '.join(memory)} |")
    where = f"a copy on {args.receiver_copy}" if args.receiver_copy else "host memory, whole"
    for index in sorted(measured[0]["receivers"], key=int):
        extras = ", ".join(f"{r['receivers'][index][0] / MiB:.0f}" for r in measured)
        over_start = max(r["receivers"][index][1] for r in ranks[0]["rounds"])
        print(f"  subscriber {index} (assembling into {where}): peak resident memory "
              f"{over_start / MiB:.0f} MiB over its resident memory before the first version "
              f"(a version: {total / MiB:.0f} MiB); over its resident memory at each "
              f"repeat's manifest {extras} MiB")
    for rank in ranks:
        rows = [r for r in rank["rounds"] if r["round"] > 0]
        extras = ", ".join(f"{r['extra'] / MiB:.0f}" for r in rows)
        before = median([r["before"] for r in rows]) / MiB
        warm = rank["rounds"][0]
        over_first = (max(r["peak"] for r in rows) - warm["before"]) / MiB
        print(f"  rank {rank['rank']}: {before:.0f} MiB resident before a publish; extra per "
              f"repeat {extras} MiB (warm-up {warm['extra'] / MiB:.0f}); highest peak over "
              f"the resident memory before the warm-up {over_first:.0f} MiB = "
              f"{over_first * MiB / bucket:.2f} b; "
              f"{median([r['samples'] for r in rows]):.0f} samples a publish")


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    if args.subscriber:
        subscriber(args.subscriber, args.index)
        return
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    import torch
    from bench_model import SHAPES, ensure_bench_model

    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        sys.exit(f"bench-publish: error: --dtype {args.dtype!r} is not a torch dtype")
    if args.model:
        model = Path(args.model)
    elif args.shape in SHAPES:
        model = ensure_bench_model(args.shape)
    else:
        sys.exit(f"bench-publish: error: unknown --shape {args.shape!r} (choose from "
                 f"{', '.join(sorted(SHAPES))})")
    runs = [args] if args.lora_rank <= 0 else [
        argparse.Namespace(**{**vars(args), "lora_rank": 0, "lora_adapters": False}),
        argparse.Namespace(**{**vars(args), "lora_adapters": False}),
        argparse.Namespace(**{**vars(args), "lora_adapters": True})]
    publish_s = []
    for each in runs:
        if len(runs) > 1:
            what = ("full model" if not each.lora_rank else
                    f"LoRA rank {each.lora_rank}, "
                    + ("adapters alone" if each.lora_adapters else "merged weights"))
            print(f"\n== {what} ==", flush=True)
        try:
            with tempfile.TemporaryDirectory(prefix="bench-publish-") as tmp:
                ranks = run(each, model, Path(tmp))
        except Failure as exc:
            sys.exit(f"bench-publish: error: {exc}")
        report(each, model, ranks)
        measured = [r for r in ranks[0]["rounds"] if r["round"] > 0]
        publish_s.append((median([r["publish_s"] for r in measured]),
                          median([r["returned_s"] - (r["send_s"] or 0.0) for r in measured])))
    if len(runs) > 1:
        (full, full_gather), (lora, lora_gather), (adapters, _) = publish_s
        print(f"\nLoRA rank {args.lora_rank} publish (merged, W + (alpha/r) B A per bucket) "
              f"{lora:.3g} s vs full publish {full:.3g} s: ratio {lora / full:.2f}; rank 0's "
              f"gather (where the merge runs) {lora_gather:.3g} s vs {full_gather:.3g} s: "
              f"ratio {lora_gather / full_gather:.2f}")
        print(f"LoRA rank {args.lora_rank} publish (adapters alone, for vLLM's LoRA support) "
              f"{adapters:.3g} s vs full publish {full:.3g} s: ratio {adapters / full:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
