"""What a check found, one record each, and the run's JSON summary.

Standard library only: the summary must be written even when the wheels a check needs
failed to install. A record is passed, failed (``error`` says why) or skipped (``skipped``
says why; a skip is no failure); ``numbers`` holds what was measured, by name.
"""

from __future__ import annotations

import json
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

Number = float | int | None


@dataclass
class CheckResult:
    """One check: ``name`` (``"A/grpo"``...), whether it passed, what it measured."""

    name: str
    passed: bool
    numbers: dict[str, Number] = field(default_factory=dict)
    error: str | None = None
    skipped: str | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # what a person may want to read

    @classmethod
    def failure(cls, name: str, error: str, **numbers: Number) -> CheckResult:
        return cls(name=name, passed=False, numbers=numbers, error=error)

    @classmethod
    def skip(cls, name: str, reason: str) -> CheckResult:
        return cls(name=name, passed=True, skipped=reason)

    def line(self) -> str:
        """One line for a person following the run."""
        verdict = "skipped" if self.skipped else "passed" if self.passed else "FAILED"
        shown = ", ".join(f"{key} {_short(value)}" for key, value in self.numbers.items())
        why = f" ({self.skipped})" if self.skipped else f": {self.error}" if self.error else ""
        return f"{self.name:<24} {verdict}{why}" + (f"  [{shown}]" if shown else "")


def _short(value: Number) -> str:
    if isinstance(value, float) and math.isfinite(value) and value != 0:
        return f"{value:.3g}"
    return str(value)


def bounded(name: str, value: float, limit: float, problems: list[str]) -> None:
    """Append to ``problems`` unless ``value`` is a finite number at most ``limit``."""
    if not (math.isfinite(value) and value <= limit):
        problems.append(f"{name} = {value:.3g} exceeds {limit:g}")


class Report:
    """The records of one run, printed as they come and written as JSON at the end."""

    def __init__(self, environment: dict[str, object]) -> None:
        self.environment = environment
        self.results: list[CheckResult] = []
        self.began = time.monotonic()

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def add(self, result: CheckResult) -> None:
        self.results.append(result)
        print(f"gpu-check: {result.line()}", flush=True)

    def run(self, name: str, check: Callable[[], list[CheckResult]]) -> None:
        """Run ``check`` and add its records; an exception becomes a failed record named
        ``name``, so one failing check never stops the others."""
        print(f"gpu-check: {name} ...", flush=True)
        began = time.monotonic()
        try:
            results = check()
        except Exception:  # noqa: BLE001 - any failure is this check's, reported in full
            results = [CheckResult.failure(name, traceback.format_exc(limit=-8).strip())]
        for result in results:
            result.seconds = result.seconds or round(time.monotonic() - began, 1)
            self.add(result)

    def write(self, path: Path) -> None:
        summary = {"passed": self.passed, "seconds": round(time.monotonic() - self.began, 1),
                   "environment": self.environment,
                   "checks": [asdict(r) for r in self.results]}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_finite(summary), indent=2, allow_nan=False) + "\n")


def _finite(value: object) -> object:
    """``value`` with every NaN or infinity spelled as a string (``"nan"``, ``"inf"``), which
    strict JSON readers accept."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value
