"""The ``relay`` command: one subcommand per job, each a module with its own ``main(argv)``.

    relay launch [TOPOLOGY.toml] [RUN.toml] [key=value ...] [--dry-run]
    relay launch --resume RUN_DIR [key=value ...]
    relay attach RUN_DIR --name gen9 [--host H] ...
    relay replay RUN_DIR [--from-step N] ...
    relay export RUN_DIR [--step N] OUT_DIR
    relay export RUN_DIR/checkpoints/step-N [--dtype D] [--critic | --prm | --merge-lora] OUT_DIR
    relay import-verl VERL_CHECKPOINT OUT_DIR [--dtype D]
    relay sft [CONFIG.yaml|CONFIG.toml] [key=value ...]
    relay plot RUN_DIR [RUN_DIR ...] [--out DIR]
    relay rollouts RUN_DIR --step N [--jsonl FILE]
    relay prepare-data {arithmetic,gsm8k} ...
    relay keys KEYS_DIR
    relay bench {e2e,engine,learner,publish,rewards,transport} ...

``relay COMMAND --help`` says more of each.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys

from relay import __version__

# name: (module, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "launch": ("relay.launch", "start a run: topology, run config, key=value overrides"),
    "attach": ("relay.attach", "attach one more generator to a running job"),
    "replay": ("relay.replay", "re-train a run's recorded batches offline and compare"),
    "export": ("relay.export", "write a checkpoint's policy as a Hugging Face folder"),
    "import-verl": ("relay.import_verl", "turn a verl FSDP checkpoint into Hugging Face folders"),
    "sft": ("relay.sft", "supervised fine-tuning with verl's SFT keys"),
    "plot": ("relay.plot", "draw the curves of one or more runs as PNG files"),
    "rollouts": ("relay.rollouts", "print or dump the rollout groups a step trained on"),
    "prepare-data": ("relay.prepare_data", "write prompt datasets in verl's schema"),
    "keys": ("relay.keys", "create the CURVE key folders a secured topology needs"),
    "bench": ("relay.bench", "run a benchmark of a source checkout (tools/bench-*.py)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return (f"usage: relay COMMAND [ARGS ...]   (relay {__version__})\n\n"
            "Relay: asynchronous RL post-training for Hugging Face LLMs.\n\ncommands:\n"
            + "\n".join(lines) + "\n\n`relay COMMAND --help` says more of each.")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"relay {__version__}")
        return 0
    name, args = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean `relay {close[0]}`?)" if close else ""
        print(f"relay: unknown command {name!r}{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    sys.argv[0] = f"relay {name}"  # each command's argparse names itself after argv[0]
    try:
        return module.main(args)
    except BrokenPipeError:  # `relay rollouts RUN --step 4 | head`: the reader has had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
