"""The registry of advantage estimators and policy-loss modes: one typed entry per name.

An entry declares what its algorithm needs from the rest of Relay (samples per prompt, a
greedy baseline, a critic, an implicit PRM, a frozen reference model), how its loss behaves
(aggregated per sequence; zero gradient where the advantage is zero) and which config keys it
reads. Everything outside ``relay.algorithms`` asks the entry (``advantage_estimator(name)``,
``policy_loss_mode(name)``) and never compares a name. The built-in entries are declared
beside their formulas with ``register_adv_estimator`` / ``register_policy_loss``
(``advantages.py``, ``prime.py``, ``policy_loss.py``); this module imports nothing of them
until a lookup asks.

Users add theirs the same way, or name a function by path where the config takes a name:
``algorithm.adv_estimator = "my_pkg.adv:my_est"`` or ``"path/to/file.py:my_est"`` (as verl's
``custom_reward_function``). A lookup by path imports it in the process that asks (so in
every process that reads the entry), and returns the entry its decorator declared, or, for
an undecorated function, an entry that declares nothing. ``check_protocol`` says whether an
entry's function takes the arguments its caller passes.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from relay.algorithms.user_code import UserCodeError, is_spec, load_function

F = TypeVar("F", bound=Callable[..., Any])

# The modules whose decorated functions are the built-in entries.
_BUILTIN_MODULES = ("relay.algorithms.advantages", "relay.algorithms.prime",
                    "relay.algorithms.policy_loss")


@dataclass(frozen=True, kw_only=True)
class AdvantageEntry:
    """One ``algorithm.adv_estimator``.

    ``function``: ``advantages.Estimator`` (inputs, norm_adv_by_std_in_grpo, gamma) ->
    advantages (B, T); for an estimator with a learned model (``critic``, ``prm``) the
    function the learner calls with that model's outputs (another signature).
    ``group``: its baseline comes from the other samples of the prompt (rollout.n >= 2).
    ``greedy_baseline``: the generators also decode one greedy response per prompt.
    ``critic`` / ``prm``: the learner trains a value model / an implicit process reward model.
    ``reference``: a frozen reference model (PRIME's pi_ref of its PRM).
    ``config_keys``: the keys it reads beyond ``algorithm.adv_estimator``.
    """

    name: str
    function: Callable[..., Any]
    paper: str = ""
    group: bool = False
    greedy_baseline: bool = False
    critic: bool = False
    prm: bool = False
    reference: bool = False
    config_keys: tuple[str, ...] = ()

    @property
    def protocol(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The arguments its caller passes: (positional, keyword)."""
        if self.critic:  # gae_advantages
            return (("token_rewards", "values", "response_mask", "gamma", "lam"),
                    ("kept_mask",))
        if self.prm:  # prime.prime_advantages
            return (("process_rewards", "outcome_rewards", "response_mask", "group_ids",
                     "reward_dpo_coef", "reward_gt_coef"), ("kept_mask",))
        return ("inputs", "norm_adv_by_std_in_grpo", "gamma"), ()  # advantages.Estimator

    def samples_per_prompt(self, n: int) -> int:
        """Responses decoded per prompt: ``rollout.n``, plus the greedy one if it needs it."""
        return n + int(self.greedy_baseline)

    @property
    def learned_models(self) -> tuple[str, ...]:
        """The models the learner trains for it beside the policy: "critic", "prm"."""
        return tuple(part for part, needed in (("critic", self.critic), ("prm", self.prm))
                     if needed)


@dataclass(frozen=True, kw_only=True)
class PolicyLossEntry:
    """One ``actor.policy_loss.loss_mode``.

    ``function``: (logprobs, proximal_logprobs, advantages, response_mask, config, clip, *,
    generator) -> ``PolicyLossTerms`` (``policy_loss.py``'s protocol).
    ``per_sequence``: its objective is per sequence, so its policy loss is aggregated with
    seq-mean-token-mean whatever ``actor.loss_agg_mode`` says (as verl forces).
    ``zero_advantage_zero_gradient``: a row whose advantages are all 0 has exactly zero loss
    and gradient, so the learner may skip its passes (``actor.skip_zero_advantage``).
    ``config_keys``: the keys it reads beyond ``actor.policy_loss.loss_mode``.
    """

    name: str
    function: Callable[..., Any]
    paper: str = ""
    per_sequence: bool = False
    zero_advantage_zero_gradient: bool = False
    config_keys: tuple[str, ...] = ()

    @property
    def protocol(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The arguments ``policy_loss.policy_loss`` passes: (positional, keyword)."""
        return (("logprobs", "proximal_logprobs", "advantages", "response_mask", "config",
                 "clip"), ("generator",))


ADV_ESTIMATORS: dict[str, AdvantageEntry] = {}
POLICY_LOSSES: dict[str, PolicyLossEntry] = {}
# Entries of functions named by path, by (what, path): looked up once per process, not at
# every call (``policy_loss`` asks at every micro-batch pass).
_BY_PATH: dict[tuple[str, str], Any] = {}


def register_adv_estimator(name: str, **declared: Any) -> Callable[[F], F]:
    """Decorator: register the function as the advantage estimator ``name`` with the
    ``AdvantageEntry`` fields ``declared``; the function is returned unchanged."""
    def register(function: F) -> F:
        _add(ADV_ESTIMATORS, AdvantageEntry(name=name, function=function, **declared))
        return function
    return register


register_adv_est = register_adv_estimator  # verl's name, so a verl user's decorator works


def register_policy_loss(name: str, **declared: Any) -> Callable[[F], F]:
    """Decorator: register the function as the policy-loss mode ``name`` with the
    ``PolicyLossEntry`` fields ``declared``; the function is returned unchanged."""
    def register(function: F) -> F:
        _add(POLICY_LOSSES, PolicyLossEntry(name=name, function=function, **declared))
        return function
    return register


def advantage_estimator(name: str) -> AdvantageEntry:
    """The entry of ``algorithm.adv_estimator = name`` (a registered name or a path);
    ValueError naming the known ones, or why the path does not load."""
    return _lookup(ADV_ESTIMATORS, name, "advantage estimator", AdvantageEntry)


def policy_loss_mode(name: str) -> PolicyLossEntry:
    """The entry of ``actor.policy_loss.loss_mode = name`` (a registered name or a path);
    ValueError naming the known ones, or why the path does not load."""
    return _lookup(POLICY_LOSSES, name, "loss_mode", PolicyLossEntry)


def check_protocol(entry: AdvantageEntry | PolicyLossEntry) -> None:
    """ValueError unless ``entry.function`` accepts the arguments its caller passes."""
    positional, keywords = entry.protocol
    function = entry.function
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        signature.bind(*positional, **{key: None for key in keywords})
    except TypeError as exc:
        empty = inspect.Parameter.empty
        bare = signature.replace(
            parameters=[p.replace(annotation=empty, default=empty)
                        for p in signature.parameters.values()], return_annotation=empty)
        origin, qualname = _where(function)
        call = ", ".join([*positional, *(f"{key}=" for key in keywords)])
        raise ValueError(f"{qualname}{bare} ({origin}) does not take the arguments Relay "
                         f"passes, ({call}): {exc}") from None


def advantage_estimators() -> dict[str, AdvantageEntry]:
    """Every registered estimator, by name (the built-ins first)."""
    _load_builtins()
    return dict(ADV_ESTIMATORS)


def policy_loss_modes() -> dict[str, PolicyLossEntry]:
    """Every registered loss mode, by name (the built-ins first)."""
    _load_builtins()
    return dict(POLICY_LOSSES)


def _add(table: dict[str, Any], entry: AdvantageEntry | PolicyLossEntry) -> None:
    """Register ``entry``; the same function again (its file imported as a module and by
    path, or reloaded) replaces its entry, another function under a taken name is refused."""
    known = table.get(entry.name)
    if known is not None and _where(known.function) != _where(entry.function):
        raise ValueError(f"{entry.name!r} is registered already, by "
                         f"{known.function.__module__}.{known.function.__qualname__}")
    table[entry.name] = entry


def _where(function: Callable[..., Any]) -> tuple[str, str]:
    """Where a function was defined: its source file (else its module) and qualified name."""
    code = getattr(function, "__code__", None)
    origin = code.co_filename if code is not None else getattr(function, "__module__", "")
    return origin, getattr(function, "__qualname__", "")


def _lookup(table: dict[str, Any], name: str, what: str, kind: type) -> Any:
    _load_builtins()
    if name in table:
        return table[name]
    if not is_spec(name):
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(table)} (or a "
                         "function by path: 'module:function', 'path/to/file.py:function')")
    if (what, name) not in _BY_PATH:
        _BY_PATH[what, name] = _load_entry(table, name, what, kind)
    return _BY_PATH[what, name]


def _load_entry(table: dict[str, Any], name: str, what: str, kind: type) -> Any:
    """The entry of the function at path ``name``: its decorator's declaration, else one
    that declares nothing."""
    try:
        function = load_function(name, what)
    except UserCodeError as exc:
        raise ValueError(str(exc)) from exc
    declared = [entry for entry in table.values() if _where(entry.function) == _where(function)]
    if declared:  # decorated: its declaration, with the function this import made
        return dataclasses.replace(declared[0], function=function)
    return kind(name=name, function=function)


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
