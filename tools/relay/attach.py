"""Attach an extra generator to a running job.

    python tools/attach-generator.py RUN_DIR [--host H | --ray] [--engine E] [--device D]
                                     [--gpus G,...] [--threads N] [--name NAME]

Starts ``relay.generators.main --attached`` under a fresh name (``attached-<host>-<pid>-<hex>``
unless ``--name`` gives one) with the run directory's configs and keys: it joins the job,
fetches the current weights and leases prompts like the topology's generators, and the
launcher's status line counts it. Engine, device, GPUs and threads default to the topology's
first generator's (its GPUs only while the device is CUDA); ``--gpus`` are set as the
topology's ``gpus`` are (``CUDA_VISIBLE_DEVICES``), and a GPU that a process of the run lists
on the same host is refused, naming that process. ``--host H`` starts it on H over the
topology's ssh command (the run directory must be at the same path there). It runs in the
foreground, its output also in ``RUN_DIR/logs/<name>.log``; Ctrl-C or SIGTERM detaches it,
returning its unfinished leases to the pool. A name held by a live generator is refused,
never taken over. ``--ray`` starts it as an actor of the job's Ray cluster instead (a run
launched with ``launcher.backend = "ray"``), reserving the topology's first generator's
resources (``relay.launcher.ray_backend.run_attached``).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import get_args

import msgspec

from relay.configs import ConfigError
from relay.configs.loader import COMMAND_LINE
from relay.configs.gpu_placement import (
    GpuClaim,
    check_engine_gpus,
    check_gpu_placement,
    on_cuda,
    topology_claims,
)
from relay.configs.rundir import RunContext, load_run_dir
from relay.configs.topology_schema import EngineName, GeneratorPlacement
from relay.launcher.child import module_argv
from relay.launcher.plan import ProcessSpec, process_env
from relay.launcher.resources import Demand, engine_gpus
from relay.transport.endpoints import is_loopback
from relay.transport.messages import Heartbeat, HeartbeatAck, Shutdown
from relay.transport.sockets import Client, PeerTimeout

PROBE_TIMEOUT_S = 10.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line (module docstring); argparse exits naming a bad option."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the running job's run directory")
    parser.add_argument("--host", default="127.0.0.1", help="where to run it (default: here)")
    parser.add_argument("--engine", choices=get_args(EngineName),
                        help="inference engine (default: the topology's first generator's)")
    parser.add_argument("--device", help="device (default: the topology's first generator's)")
    parser.add_argument("--gpus", type=gpu_list, help="the GPUs of its host it runs on, e.g. "
                                                      "2 or 2,3; its device is then cuda "
                                                      "(default: the topology's first "
                                                      "generator's while the device is CUDA)")
    parser.add_argument("--threads", type=int, help="torch threads, 0 for torch's default "
                                                    "(default: the topology's first generator's)")
    parser.add_argument("--name", help="the generator's name (default: a fresh one)")
    parser.add_argument("--ray", action="store_true",
                        help="run it as an actor of the job's Ray cluster (a run launched "
                             "with launcher.backend = \"ray\"), reserving what the "
                             "topology's first generator reserves")
    args = parser.parse_args(argv)
    if args.ray and (args.host != "127.0.0.1" or args.gpus is not None):
        parser.error("--ray lets Ray choose the node and its GPUs: drop --host and --gpus")
    if args.threads is not None and args.threads < 0:
        parser.error(f"--threads must be 0 or more, not {args.threads}")
    return args


def gpu_list(text: str) -> list[int]:
    """``--gpus 2,3``: GPU indices, comma-separated."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indices like 2 or 2,3, got {text!r}")


def fresh_name(host: str) -> str:
    """``attached-<host>-<pid>-<4 hex>``: unique to this invocation, never a topology name."""
    short = (socket.gethostname() if is_loopback(host) else host).split(".")[0]
    return f"attached-{short}-{os.getpid()}-{secrets.token_hex(2)}"


def check_live(ctx: RunContext) -> str:
    """"" when the run's buffer answers and the run goes on, else why not. The probe is a
    heartbeat under a name no generator holds, which the buffer answers without effect."""
    client = Client(ctx.buffer_endpoint, keys=ctx.client_keys())
    probe = Heartbeat(generator_id=f"attach-probe-{secrets.token_hex(8)}", version=0)
    try:
        reply = client.request(probe, PROBE_TIMEOUT_S)
    except PeerTimeout:
        return (f"no buffer answers at {ctx.buffer_endpoint} within {PROBE_TIMEOUT_S:.0f} s: "
                f"is the run in {ctx.run_dir} still going?")
    finally:
        client.close()
    if isinstance(reply, Shutdown):
        return f"the run in {ctx.run_dir} is over ({reply.reason})"
    if not isinstance(reply, HeartbeatAck):
        return f"the buffer at {ctx.buffer_endpoint} answered {type(reply).__name__}: {reply}"
    return ""


def attached_placement(ctx: RunContext, args: argparse.Namespace,
                       name: str) -> GeneratorPlacement:
    """The attached generator's placement, as ``relay.generators.main --attached`` builds it (the
    topology's first generator's, with the command line's engine, device and threads), with
    its GPUs: ``--gpus``, else the first generator's while the device is CUDA. Checked as
    the topology's are, and against the GPUs the run's processes list on ``args.host``;
    ``ConfigError`` naming the option or the process that holds the GPU."""
    given = {"engine": args.engine, "device": args.device, "threads": args.threads,
             "gpus": args.gpus}
    fields = msgspec.structs.asdict(ctx.topology.generators[0])
    fields |= {key: value for key, value in given.items() if value is not None}
    fields |= {"name": name, "host": args.host}
    if args.gpus is None and not on_cuda(fields["device"]):
        fields["gpus"] = None
    try:
        placement = msgspec.convert(fields, GeneratorPlacement)
    except msgspec.ValidationError as exc:
        raise ConfigError(COMMAND_LINE, "", str(exc)) from None
    check_engine_gpus(placement, COMMAND_LINE, gpus_key="--gpus", device_key="--device")
    attached = GpuClaim(process=f"generator {name}", key="--gpus", host=args.host,
                        device=placement.device, gpus=placement.gpus)
    check_gpu_placement([*topology_claims(ctx.topology, ctx.run.evaluates), attached],
                        COMMAND_LINE)
    return placement


def generator_spec(ctx: RunContext, args: argparse.Namespace, name: str,
                   placement: GeneratorPlacement) -> ProcessSpec:
    """The generator process: ``relay.generators.main --attached`` on ``args.host``, with the
    environment the launcher gives the topology's generators (``relay.launcher.plan``)."""
    python = sys.executable if is_loopback(args.host) else ctx.topology.launcher.remote_python
    argv = module_argv(python, "relay.generators.main", "--run-dir", str(ctx.run_dir),
                       "--name", name, "--attached")
    for option in ("engine", "device", "threads"):
        if getattr(args, option) is not None:
            argv += [f"--{option}", str(getattr(args, option))]
    env = process_env(args.host, placement.device, placement.gpus, engine=placement.engine,
                      environ=os.environ)
    return ProcessSpec(name=name, role="generator", host=args.host, essential=False, argv=argv,
                       env=env)


def run_in_foreground(command: list[str], log: Path, env: dict[str, str]) -> int:
    """Run ``command`` with ``env`` added to this environment, its output to this terminal
    and to ``log``; SIGINT and SIGTERM go on to it (the generator then detaches) and its
    exit code is returned."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True, env=os.environ | env)

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    assert child.stdout is not None
    with open(log, "a") as out:
        for line in child.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            out.write(line)
            out.flush()
    return child.wait()


def run_on_ray(ctx: RunContext, spec: ProcessSpec, placement: GeneratorPlacement,
               log: Path) -> int | None:
    """The generator as an actor of the run's Ray cluster (``relay.launcher.ray_backend``),
    reserving ``placement``'s resources; its exit code, or None (said why) when Ray cannot
    place it."""
    from relay.launcher.backends import PlacementError
    from relay.launcher.ray_backend import run_attached

    demand = Demand(name=spec.name, role="generator", section="--ray", cpus=placement.cpus,
                    gpus=engine_gpus(placement), memory_gib=placement.memory_gib,
                    resources=dict(placement.resources))
    try:
        return run_attached(ctx.topology.launcher.ray, spec, demand, ctx.run_dir, log)
    except PlacementError as exc:
        print(f"relay attach: {exc}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    """Check the run, start the generator, wait for it; the exit code: 0 when it detached,
    2 for a folder that is not a run or a placement refused (``attached_placement``), 1 for
    a run whose buffer does not answer, else the generator's (3: the name belongs to a live
    generator)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        ctx = load_run_dir(args.run_dir)
    except ConfigError as exc:
        print(f"relay attach: {args.run_dir} is not a run directory: {exc}", file=sys.stderr)
        return 2
    name = args.name or fresh_name(args.host)
    try:
        placement = attached_placement(ctx, args, name)
    except ConfigError as exc:
        print(f"relay attach: {exc}", file=sys.stderr)
        return 2
    problem = check_live(ctx)
    if problem:
        print(f"relay attach: {problem}", file=sys.stderr)
        return 1
    spec = generator_spec(ctx, args, name, placement)
    log = ctx.run_dir / "logs" / f"{name}.log"
    where = "an actor of the job's Ray cluster" if args.ray else args.host
    print(f"relay attach: starting {name} on {where}, joining {ctx.run_dir} (output "
          f"also in {log}); Ctrl-C detaches it", flush=True)
    if args.ray:
        code = run_on_ray(ctx, spec, placement, log)
        if code is None:
            return 2
    else:
        code = run_in_foreground(spec.command_line(ctx.topology.launcher.ssh,
                                                   ctx.topology.launcher.remote_workdir), log,
                                 spec.env if spec.local else {})
    if code == 0:
        print(f"relay attach: {name} left; its unfinished leases went back to the pool")
        return 0
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    print(f"relay attach: {name} {how} (see {log})", file=sys.stderr)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
