"""The registry of advantage estimators and loss modes: what each entry declares, and that
nothing outside ``algorithms/`` compares their names."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import msgspec
import pytest
import torch

from relay.algorithms import registry
from relay.algorithms.advantages import (
    ESTIMATORS,
    AdvantageInputs,
    AdvEstimator,
    compute_advantages,
)
from relay.algorithms.policy_loss import (
    LOSS_MODES,
    LossMode,
    PolicyLossConfig,
    policy_loss,
    policy_loss_agg_mode,
)
from relay.configs.run_schema import RunConfig

REPO = Path(__file__).resolve().parents[2]
USER = REPO / "tests" / "e2e" / "user_algorithms.py"  # a user's file: see its docstring


def builtin(entries: dict[str, typing.Any]) -> dict[str, typing.Any]:
    """The entries Relay ships (a test may have registered a user's too)."""
    return {name: entry for name, entry in entries.items()
            if entry.function.__module__.startswith("relay.algorithms.")}


def test_the_config_literals_name_the_built_in_entries() -> None:
    estimators = builtin(registry.advantage_estimators())
    assert set(typing.get_args(AdvEstimator)) == set(estimators)
    assert set(typing.get_args(LossMode)) == set(builtin(registry.policy_loss_modes()))
    assert set(ESTIMATORS) == {name for name, entry in estimators.items()
                               if not entry.learned_models}
    assert set(LOSS_MODES) == set(builtin(registry.policy_loss_modes()))


def test_estimators_declare_what_they_need() -> None:
    # The lists these flags replaced: configs/checks.py's GROUP_ESTIMATORS, the learner's and
    # the hub's comparisons with "gae", "prime" and "remax".
    entries = builtin(registry.advantage_estimators())

    def having(flag: str) -> set[str]:
        return {name for name, entry in entries.items() if getattr(entry, flag)}

    assert having("group") == {"grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg",
                               "grpo_passk", "prime"}
    assert having("greedy_baseline") == {"remax"}
    assert having("critic") == {"gae"}
    assert having("prm") == having("reference") == {"prime"}
    assert entries["gae"].learned_models == ("critic",)
    assert entries["remax"].samples_per_prompt(4) == 5
    assert entries["grpo"].samples_per_prompt(4) == 4


def test_loss_modes_declare_how_they_aggregate_and_skip() -> None:
    entries = builtin(registry.policy_loss_modes())
    assert {name for name, entry in entries.items() if entry.per_sequence} == {
        "gspo", "sapo", "geo_mean"}
    assert {name for name, entry in entries.items() if entry.zero_advantage_zero_gradient} == {
        "vanilla", "gspo", "gpg", "geo_mean", "cispo", "sapo"}


@pytest.mark.parametrize("mode", sorted(LOSS_MODES))
def test_zero_advantage_means_zero_gradient_where_declared(mode: str) -> None:
    # A row of zero advantages beside a row of nonzero ones: where the entry declares it, the
    # zero row's loss and gradient are exactly 0, so the learner may skip it.
    torch.manual_seed(0)
    logprobs = (-torch.rand(2, 5) - 0.1).requires_grad_()
    proximal = logprobs.detach() + 0.3 * torch.randn(2, 5)
    advantages = torch.tensor([[0.0] * 5, [1.5] * 5])
    mask = torch.ones(2, 5)
    terms = policy_loss(logprobs, proximal, advantages, mask,
                        PolicyLossConfig(loss_mode=mode),  # type: ignore[arg-type]
                        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    (grad,) = torch.autograd.grad(terms.loss.sum(), logprobs)
    if registry.policy_loss_mode(mode).zero_advantage_zero_gradient:
        assert torch.equal(terms.loss[0], torch.zeros(5))
        assert torch.equal(grad[0], torch.zeros(5))


def _schema_has(key: str) -> bool:
    section: typing.Any = RunConfig
    for part in key.split("."):
        fields = {field.name: field.type for field in msgspec.structs.fields(section)}
        if part not in fields:
            return False
        section = fields[part]
    return True


def test_declared_config_keys_exist_in_the_run_schema() -> None:
    entries = [*registry.advantage_estimators().values(), *registry.policy_loss_modes().values()]
    keys = {key for entry in entries for key in entry.config_keys}
    assert keys and not {key for key in keys if not _schema_has(key)}


def test_verls_decorator_name_is_accepted() -> None:
    assert registry.register_adv_est is registry.register_adv_estimator


def test_a_name_alone_registers_an_entry_that_declares_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "POLICY_LOSSES", dict(registry.POLICY_LOSSES))

    @registry.register_policy_loss("test_only_a_name")
    def mine(*args: typing.Any, **kwargs: typing.Any) -> None:
        raise AssertionError

    entry = registry.policy_loss_mode("test_only_a_name")
    assert entry.function is mine and entry.paper == "" and not entry.per_sequence
    registry.check_protocol(entry)  # *args, **kwargs take anything


def test_a_name_registered_twice_is_refused_naming_the_first() -> None:
    def other(inputs: typing.Any, norm_by_std: bool, gamma: float) -> torch.Tensor:
        raise AssertionError

    with pytest.raises(ValueError, match="'grpo' is registered already, by "
                                         "relay.algorithms.advantages.grpo"):
        registry.register_adv_estimator("grpo", paper="")(other)


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; known: .*remax"):
        registry.advantage_estimator("ppo")
    with pytest.raises(ValueError, match="unknown loss_mode 'ppo2'; known: vanilla, gspo"):
        registry.policy_loss_mode("ppo2")


# Where a registered name stands for something else: verl's reward manager "prime"; the GPU
# check's scenario labels (each sets its estimator by an override, as a user does).
_OTHER_MEANINGS = {("configs/verl_keys.py", "prime"),
                   *(("tools/gpucheck/learner_check.py", name)
                     for name in ("grpo", "gae", "prime"))}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)):
            ids.add(id(body[0].value))
    return ids


def test_no_estimator_or_loss_name_is_a_string_outside_algorithms() -> None:
    # Every string literal of the installed packages outside algorithms/ (and the tools'
    # scripts) whose whole value is a registered name: a comparison, a table key or a tuple
    # of names that belongs in a registry entry. Messages that mention a name pass.
    names = (set(builtin(registry.advantage_estimators()))
             | set(builtin(registry.policy_loss_modes())))
    folders = ["learner", "generators", "buffer", "transport", "configs", "tools"]
    found = []
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            tree = ast.parse(path.read_text(), relative)
            docstrings = _docstrings(tree)
            for node in ast.walk(tree):
                if (isinstance(node, ast.Constant) and node.value in names
                        and id(node) not in docstrings
                        and (relative, node.value) not in _OTHER_MEANINGS):
                    found.append(f"{relative}:{node.lineno}: {node.value!r}")
    assert not found, "\n".join(found)


# -- a user's own, by path --------------------------------------------------------------


def inputs() -> AdvantageInputs:
    return AdvantageInputs(rewards=torch.tensor([1.0, 0.0, 0.5, 0.5]),
                           group_ids=torch.tensor([0, 0, 1, 1]),
                           response_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]] * 2))


def test_a_decorated_function_by_file_path_brings_its_declared_entry() -> None:
    spec = f"{USER}:centered_score"
    entry = registry.advantage_estimator(spec)
    assert entry.name == "user_centered_score" and entry.group and not entry.learned_models
    registry.check_protocol(entry)
    assert registry.advantage_estimator("user_centered_score").function is entry.function
    advantages = compute_advantages(spec, inputs(), norm_adv_by_std_in_grpo=True, gamma=1.0)
    assert torch.equal(advantages, torch.tensor([[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0],
                                                 [0.0, 0.0]]))


def test_an_undecorated_function_by_path_declares_nothing() -> None:
    spec = f"{USER}:plain_centered_score"
    entry = registry.advantage_estimator(spec)
    assert entry.name == spec and not (entry.group or entry.greedy_baseline
                                       or entry.learned_models or entry.reference)


def test_a_function_by_path_is_loaded_once_per_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``policy_loss`` asks for its entry at every micro-batch pass: a path is resolved and
    loaded at the first lookup only."""
    spec = f"{USER}:clipped_reinforce"
    first = registry.policy_loss_mode(spec)
    monkeypatch.setattr(registry, "load_function",
                        lambda *args: pytest.fail("loaded again"))
    assert registry.policy_loss_mode(spec) is first


def test_a_loss_by_module_path_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(USER.parent))
    spec = "user_algorithms:clipped_reinforce"
    entry = registry.policy_loss_mode(spec)
    assert entry.name == "user_clipped_reinforce" and entry.zero_advantage_zero_gradient
    assert policy_loss_agg_mode(spec, "token-mean") == "token-mean"
    logprobs = torch.full((1, 2), -1.0, requires_grad=True)
    terms = policy_loss(logprobs, logprobs.detach(), torch.tensor([[2.0, 2.0]]),
                        torch.ones(1, 2), PolicyLossConfig(loss_mode=spec),
                        clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    (grad,) = torch.autograd.grad(terms.loss.sum(), logprobs)
    assert torch.equal(grad, torch.tensor([[-2.0, -2.0]]))  # -A at ratio 1


def test_a_function_that_does_not_fit_the_protocol_is_refused() -> None:
    entry = registry.policy_loss_mode(f"{USER}:wrong_signature_loss")
    with pytest.raises(ValueError, match=r"wrong_signature_loss\(logprobs.*does not take the "
                                         r"arguments Relay passes, \(logprobs, "
                                         r"proximal_logprobs, .*generator=\)"):
        registry.check_protocol(entry)
    with pytest.raises(ValueError, match="does not take"):  # a loss is not an estimator
        registry.check_protocol(registry.advantage_estimator(f"{USER}:clipped_reinforce"))


def test_a_path_that_does_not_load_says_why() -> None:
    with pytest.raises(ValueError, match="advantage estimator 'missing/est.py:f': file not "
                                         "found"):
        registry.advantage_estimator("missing/est.py:f")
    with pytest.raises(ValueError, match="has no attribute 'nope'; functions it defines: "
                                         ".*centered_score"):
        registry.policy_loss_mode(f"{USER}:nope")
    with pytest.raises(ValueError, match="or a function by path"):
        registry.advantage_estimator("centered")


# -- algorithms/README.md against the registry --------------------------------------------


def readme_rows(heading: str) -> dict[str, list[list[str]]]:
    """The rows of the table under ``heading`` in algorithms/README.md, by the first name in
    backticks of their first cell, each split into its cells."""
    text = (REPO / "algorithms" / "README.md").read_text()
    section = text[text.index(f"\n## {heading}"):]
    section = section[:section.index("\n## ", 1)]
    rows: dict[str, list[list[str]]] = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip("|").split(" | ")]
            rows.setdefault(cells[0].split("`")[1], []).append(cells)
    return rows


def defined_tests() -> set[str]:
    return {line.split("(")[0].removeprefix("def ")
            for path in (REPO / "tests").rglob("test_*.py")
            for line in path.read_text().splitlines() if line.startswith("def test_")}


@pytest.mark.parametrize("heading, entries, test_column", [
    ("Advantage estimators", registry.advantage_estimators, 2),
    ("Policy-loss modes", registry.policy_loss_modes, 3)])
def test_the_readme_tables_name_every_entry_its_paper_and_existing_tests(
        heading: str, entries: typing.Callable[[], dict[str, typing.Any]],
        test_column: int) -> None:
    rows = readme_rows(heading)
    shipped = builtin(entries())
    assert set(rows) == set(shipped)
    tests = defined_tests()
    for name, entry in shipped.items():
        assert any(row[1] == entry.paper for row in rows[name]), (name, entry.paper)
        cited = {word.split("[")[0] for row in rows[name]
                 for word in row[test_column].replace("`", " ").replace(":", " ").split()
                 if word.startswith("test_") and not word.endswith(".py")}
        assert cited and cited <= tests, (name, cited - tests)


def test_the_readme_says_which_losses_are_aggregated_per_sequence() -> None:
    for name, rows in readme_rows("Policy-loss modes").items():
        forced = "(forced)" in rows[0][2]
        assert forced == registry.policy_loss_mode(name).per_sequence, name
