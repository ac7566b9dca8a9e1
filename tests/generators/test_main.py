"""A generator's placement and seed: a topology name, or an attached generator's own."""

from __future__ import annotations

import argparse
import zlib
from pathlib import Path

import pytest

from relay.configs import DEFAULT_RUN, load_run_config, load_topology
from relay.configs.rundir import RunContext
from relay.generators.main import attached_seed, parse_args, placement_and_seed

TOPOLOGY = """
[[generators]]
name = "gen0"
engine = "torch"
threads = 2
[[generators]]
name = "gen1"
"""


def context(tmp_path: Path) -> RunContext:
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY)
    return RunContext(run_dir=tmp_path, topology=load_topology(topology),
                      run=load_run_config(DEFAULT_RUN, ["trainer.seed=7"]))


def args(*extra: str) -> argparse.Namespace:
    return parse_args(["--run-dir", "unused", *extra])


def test_topology_generators_take_their_placement_and_index_seed(tmp_path: Path) -> None:
    placement, seed = placement_and_seed(context(tmp_path), args("--name", "gen1"))
    assert placement.name == "gen1" and seed == 7001


def test_an_attached_generator_defaults_to_the_first_placement_with_its_own_seed(
        tmp_path: Path) -> None:
    ctx = context(tmp_path)
    placement, seed = placement_and_seed(ctx, args("--name", "extra", "--attached"))
    assert (placement.name, placement.engine, placement.threads) == ("extra", "torch", 2)
    assert seed not in (7000, 7001)
    other, other_seed = placement_and_seed(ctx, args("--name", "extra2", "--attached",
                                                     "--engine", "lean", "--threads", "1"))
    assert (other.engine, other.threads) == ("lean", 1) and other_seed != seed


def test_names_must_fit_the_topology_or_stay_out_of_it(tmp_path: Path) -> None:
    ctx = context(tmp_path)
    with pytest.raises(SystemExit, match="no generator named 'gen9'.*--attached"):
        placement_and_seed(ctx, args("--name", "gen9"))
    with pytest.raises(SystemExit, match="'gen0' is a topology name"):
        placement_and_seed(ctx, args("--name", "gen0", "--attached"))


def test_an_attached_seed_steps_past_every_topology_seed() -> None:
    assert attached_seed("extra", 7000, 2) == 7000 + zlib.crc32(b"extra")
    every_seed_taken = 2**32  # a crc32 always falls among them
    assert attached_seed("extra", 0, every_seed_taken) >= every_seed_taken


def test_an_attached_generator_option_the_schema_refuses_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"attached generator 'extra': Expected `int` >= 0 - "
                                         r"at `\$.threads`"):
        placement_and_seed(context(tmp_path), args("--name", "extra", "--attached",
                                                   "--threads", "-1"))


def test_a_launched_generator_carries_its_lineage_token(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert args("--name", "gen0").lineage is None  # attached by hand: no lineage
    token = "0123456789abcdef" * 2
    assert args("--name", "gen0", "--lineage", token).lineage == token
    for bad in ("", "abc", "0123456g", "0123456789ABCDEF", "f" * 65, " feed0001"):
        with pytest.raises(SystemExit):
            args("--name", "gen0", "--lineage", bad)
        assert f"--lineage: a lineage is 8 to 64 lowercase hex digits, not '{bad}'" in \
            capsys.readouterr().err
