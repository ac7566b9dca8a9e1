"""A custom reward for the end-to-end tests that is slow on held-out rows only: evaluation
then takes seconds while a training step takes a fraction of one."""

import time

SECONDS_PER_HELD_OUT_SAMPLE = 0.02


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if (extra_info or {}).get("split") == "test":
        time.sleep(SECONDS_PER_HELD_OUT_SAMPLE)
    return float(sum(map(ord, solution_str)) % 2)
