"""``tools/gpu-check.py``'s command line: prepare the wheels, or install them and run the
checks (``learner_check``: A, ``weights_check``: B, ``cluster_check``: C).

Checks A and B run in worker processes (this same script with ``--worker``): each makes its
own one-rank process group, a crash or a hung collective costs that worker alone (it is
killed after ``WORKER_TIMEOUT_S``), and the CPU reference runs where no GPU is visible.
Workers print a line per step taken, passed through as they come.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from gpucheck.report import CheckResult, Report
from gpucheck.wheels import GPU_PYTHON, activate, install, prepare

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu-check.py"
CHECKS = ("A", "B", "C")
WORKER_TIMEOUT_S = {"cuda": 150.0, "cpu": 400.0}
CLUSTER_TIMEOUT_S = {"cuda": 200.0, "cpu": 600.0}
"""On a GPU, whatever hangs (a collective) costs at most 150 + 150 + 200 s: the run still
ends inside the device tool's 10 minutes a command, with its summary written."""
WORKER_TAIL_LINES = 40
LOGS_ARCHIVE = "gpu-check-logs.tar.gz"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu-check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", metavar="DIR", type=Path,
                        help="download into DIR the wheels the GPU machine lacks, and exit")
    parser.add_argument("--python-version", default=GPU_PYTHON,
                        help=f"the GPU machine's Python, for --prepare (default {GPU_PYTHON})")
    parser.add_argument("--wheels", metavar="DIR", type=Path,
                        help="install DIR's wheels offline into a temporary folder first")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where the checks run (default cuda; cpu: before any GPU)")
    parser.add_argument("--only", default=",".join(CHECKS),
                        help="the checks to run, of A,B,C (default all)")
    parser.add_argument("--out", type=Path, help="the JSON summary (default $OUT/gpu-check.json "
                                                 "when OUT is set, else runs/gpu-check.json)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.only = [c.strip() for c in args.only.split(",") if c.strip()]
    if not args.only or set(args.only) - set(CHECKS):
        parser.error(f"--only takes some of {','.join(CHECKS)}, got {','.join(args.only)}")
    if args.out is None:
        args.out = (Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "runs") \
            / "gpu-check.json"
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if args.prepare:
        total_mb = prepare(args.prepare, ROOT / "pyproject.toml", args.python_version)
        print(f"gpu-check: {total_mb:.1f} MB of wheels in {args.prepare}")
        return 0
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        return run_checks(args, Path(tmp))


def run_checks(args: argparse.Namespace, work: Path) -> int:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: --device cuda, but torch sees no GPU (torch.cuda.is_available() is "
              "False); run with --device cpu", file=sys.stderr)
        return 2
    report = Report({"device": args.device})
    model_dir = work / "model"
    report.run("setup", lambda: set_up(args, work, model_dir, report))
    if not report.passed:  # no wheels or no model: nothing else can run
        return finish(report, args.out, work)
    workers = WorkerRunner(work, model_dir, WORKER_TIMEOUT_S[args.device])
    if "A" in args.only:
        from gpucheck.learner_check import learner_checks

        report.run("A", lambda: learner_checks(workers, args.device))
    if "B" in args.only:
        from gpucheck.weights_check import weights_checks

        report.run("B", lambda: weights_checks(workers, args.device))
    if "C" in args.only:
        from gpucheck.cluster_check import cluster_checks

        report.run("C", lambda: cluster_checks(ROOT, model_dir, work, args.device,
                                               CLUSTER_TIMEOUT_S[args.device]))
    return finish(report, args.out, work)


def set_up(args: argparse.Namespace, work: Path, model_dir: Path,
           report: Report) -> list[CheckResult]:
    """Install the wheels (if any), put them and Relay on the path of this process and its
    children, describe the environment, build the model every check runs on."""
    installed = install(args.wheels, work / "site") if args.wheels else []
    activate(([work / "site"] if installed else []) + [ROOT, ROOT / "tools"])
    import torch
    import transformers

    report.environment.update(
        gpu=torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
        transformers=transformers.__version__, wheels_installed=installed)
    from gpucheck.build import save_random_qwen2

    save_random_qwen2(model_dir)
    return [CheckResult(name="setup", passed=True, numbers={"wheels": len(installed)})]


def finish(report: Report, out: Path, work: Path) -> int:
    """Write the summary; after a failure, every log of the run beside it
    (``LOGS_ARCHIVE``: the workers', the launcher's and its processes')."""
    report.write(out)
    if report.passed:
        print(f"gpu-check: passed; summary in {out}", flush=True)
        return 0
    with tarfile.open(out.parent / LOGS_ARCHIVE, "w:gz") as archive:
        for log in sorted(work.rglob("*.log")):
            archive.add(log, arcname=str(log.relative_to(work)))
    print(f"gpu-check: FAILED; summary in {out}, logs in {out.parent / LOGS_ARCHIVE}",
          flush=True)
    return 1


class WorkerRunner:
    """Starts workers (``learner``, ``weights`` or ``vllm``) on a device (``Worker``), in
    ``dtypes`` unless told otherwise."""

    dtypes = ("float32", "bfloat16")

    def __init__(self, work: Path, model_dir: Path, timeout_s: float) -> None:
        self.work, self.model_dir, self.timeout_s = work, model_dir, timeout_s

    def start(self, kind: str, device: str, *, hide_gpu: bool = False,
              dtypes: tuple[str, ...] | None = None) -> Worker:
        """A worker running ``kind``'s task on ``device`` in ``dtypes`` (default: all);
        ``hide_gpu``: it sees no GPU (``CUDA_VISIBLE_DEVICES`` empty)."""
        dtypes = dtypes or self.dtypes
        name = f"{kind}-{device}" + ("-reference" if hide_gpu else "") + \
            ("" if dtypes == self.dtypes else "-" + "-".join(dtypes))
        task = {"kind": kind, "device": device, "dtypes": list(dtypes),
                "model": str(self.model_dir), "out": str(self.work / f"{name}.pt")}
        task_file = self.work / f"{name}.json"
        task_file.write_text(json.dumps(task))
        env = dict(os.environ, TRANSFORMERS_VERBOSITY="error")
        # idle OpenMP threads sleep instead of spinning: two workers share the cores (the
        # launcher's processes run so too, relay.launcher.supervisor)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if hide_gpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return Worker(name, [sys.executable, str(TOOL), "--worker", str(task_file)], env,
                      Path(task["out"]), self.timeout_s)


class Worker:
    """A worker process, its output passed through line by line as it comes (the last
    ``WORKER_TAIL_LINES`` kept for the error text), killed with its children when it runs
    past ``timeout_s``."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], out: Path,
                 timeout_s: float) -> None:
        self.name, self.out, self.timeout_s = name, out, timeout_s
        self.began = time.monotonic()
        self.process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        self.tail: deque[str] = deque(maxlen=WORKER_TAIL_LINES)
        self.reader = threading.Thread(target=self._pass_through, daemon=True)
        self.reader.start()

    def result(self) -> dict:
        """The worker's saved outcome; ``RuntimeError`` with its last lines when it failed."""
        left = max(0.0, self.timeout_s - (time.monotonic() - self.began))
        try:
            code = self.process.wait(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            code = None
        self.reader.join(timeout=5)
        if code != 0:
            verdict = f"no exit within {self.timeout_s:g} s" if code is None else f"exit {code}"
            raise RuntimeError(f"worker {self.name}: {verdict}; its last lines:\n"
                               + "".join(self.tail))
        import torch

        return torch.load(self.out, weights_only=True)

    def _pass_through(self) -> None:
        with open(self.out.with_suffix(".log"), "w") as log:
            for line in self.process.stdout:
                log.write(line)
                self.tail.append(line)
                print(f"  [{self.name}] {line}", end="", flush=True)


def worker_main(task_file: Path) -> int:
    """Run a worker's task and save its outcome; exit at once, without the interpreter's
    teardown, where a gloo or NCCL group sometimes aborts after its last line."""
    task = json.loads(task_file.read_text())
    import torch
    import torch.distributed as dist

    from gpucheck.learner_check import learner_worker
    from gpucheck.weights_check import vllm_worker, weights_worker

    work = {"learner": learner_worker, "weights": weights_worker, "vllm": vllm_worker}
    outcome = work[task["kind"]](Path(task["model"]), task["device"], task["dtypes"])
    torch.save(outcome, task["out"])
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
