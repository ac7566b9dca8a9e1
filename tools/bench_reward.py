"""The throughput benchmark's reward (verl's ``compute_score`` signature): 0 or 1 from a hash
of the response, so every group has reward spread and every row trains. A random model's
text has no right answer; this keeps both systems doing the full work of a step."""

from __future__ import annotations

import zlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return float(zlib.crc32(solution_str.encode()) % 2)
