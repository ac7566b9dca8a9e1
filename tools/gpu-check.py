#!/usr/bin/env python3
"""The script a GPU machine runs when one is lent: Relay's learner, weights and launcher on
CUDA, checked against the CPU in the same run, with a JSON summary.

    tools/with-venv python tools/gpu-check.py --prepare .whl     # here: the missing wheels
    python3 tools/gpu-check.py --wheels .whl                     # there: install, check
    tools/with-venv python tools/gpu-check.py --device cpu       # here, before any GPU

The checks (issue 29, "Proven on a GPU"), each a record in the summary (``--out``, default
``$OUT/gpu-check.json``), the exit status non-zero on any failure:

- A: one learner step on one rank (grpo with shared prompts, dynamic batch size and the KL
  loss; gae; prime; offload; Ulysses with a group of one; LoRA rank 8; DeepSpeed ZeRO-2,
  skipped where deepspeed is not installed), fp32 against the CPU, bf16 against fp32, every
  tensor on its device, peak memory and host syncs;
- B: a published version arrives bit for bit; the lean engine (and vLLM's CUDA build when
  installed) swaps it in mid-run, its behavior log-probs the learner's; a reward model
  scores on the device as on the CPU;
- C: ``tools/launch-cluster.py`` with everything on the GPU, 30 steps of a small model.

The logic lives in ``tools/gpucheck/`` (importable from here by path, as ``launcher`` is).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run by path, tools/ comes first on sys.path, and its relay/ (the command's own modules) would
# stand in for the installed package in the workers: tools/ goes last, found only for gpucheck.
_TOOLS = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _TOOLS] + [str(_TOOLS)]

from gpucheck.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
