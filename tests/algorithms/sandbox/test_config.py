"""The sandbox's settings: defaults, verl's keys, bad values refused naming the key, and
``make_sandbox`` choosing local or SandboxFusion."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from relay.algorithms.sandbox import (FusionSandbox, Limits, LocalSandbox, SandboxSettings,
                                      make_sandbox)
from relay.algorithms.sandbox.config import SandboxFusionConfig
from relay.configs import ConfigError, load_run_config

RUN = """
[data]
train_files = "train.jsonl"

[model]
path = "builtin:tiny-arith"
"""


@pytest.fixture
def run_file(tmp_path: Path) -> Path:
    (tmp_path / "train.jsonl").write_text("{}\n")
    path = tmp_path / "run.toml"
    path.write_text(RUN)
    return path


def test_defaults_follow_verl():
    fusion = SandboxSettings().sandbox_fusion
    assert (fusion.url, fusion.max_concurrent, fusion.memory_limit_mb) == (None, 64, 1024)


def test_verls_keys_set_the_sandbox_fusion_section(run_file):
    run = load_run_config(run_file, ["reward_model.sandbox_fusion.url=http://h:8080/run_code",
                                     "reward_model.sandbox_fusion.max_concurrent=8",
                                     "sandbox.workers=3", "sandbox.limits.cpu_s=2.5"])
    assert run.sandbox.sandbox_fusion.url == "http://h:8080/run_code"
    assert run.sandbox.sandbox_fusion.max_concurrent == 8
    assert (run.sandbox.workers, run.sandbox.limits.cpu_s) == (3, 2.5)


@pytest.mark.parametrize(("override", "key"), [
    ("sandbox.workers=0", "sandbox.workers"),
    ("reward_model.sandbox_fusion.max_concurrent=0", "sandbox_fusion.max_concurrent"),
    ("sandbox.sandbox_fusion.url=localhost:8080", "sandbox.sandbox_fusion.url"),
    ("sandbox.limits.processes=0", "sandbox.limits.processes"),
    ("sandbox.limits.wall_clock=3", "sandbox.limits.wall_clock"),
])
def test_a_bad_value_is_refused_naming_the_key(run_file, override, key):
    with pytest.raises(ConfigError) as info:
        load_run_config(run_file, [override])
    assert key in str(info.value), str(info.value)


def test_limits_built_in_code_are_checked_too():
    with pytest.raises(ValueError, match=r"Limits.processes must be >= 1, got 0"):
        Limits(processes=0)
    with pytest.raises(ValueError, match=r"Limits.wall_s must be > 0"):
        Limits(wall_s=0)
    with pytest.raises(msgspec.ValidationError, match=r">= 16 - at `\$.memory_mb`"):
        msgspec.json.decode(b'{"memory_mb": 1}', type=Limits)


def test_make_sandbox_is_local_unless_a_url_is_set():
    local = make_sandbox(SandboxSettings(workers=1))
    try:
        assert isinstance(local, LocalSandbox) and local.run("print(2)").stdout == "2\n"
    finally:
        local.close()
    remote = make_sandbox(SandboxSettings(sandbox_fusion=SandboxFusionConfig(
        url="http://127.0.0.1:9/run_code", memory_limit_mb=300)))
    try:
        assert isinstance(remote, FusionSandbox) and remote.limits.memory_mb == 300
    finally:
        remote.close()
