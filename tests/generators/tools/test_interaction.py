"""relay.generators.tools.interaction: verl's interaction YAML builds simulated users by
name; verl's GSM8K user runs as Relay's and judges the last answer; bad entries are refused
naming the file, the entry and the key."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from relay.generators.tools import ToolConfigError
from relay.generators.tools.interaction import (BaseInteraction, Gsm8kInteraction,
                                                load_interactions)

VERL_GSM8K = """interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}
"""


def test_verls_gsm8k_interaction_runs_as_relays(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "interaction.yaml"
    path.write_text(VERL_GSM8K)
    with caplog.at_level(logging.WARNING):
        interactions = load_interactions(path)
    assert list(interactions) == ["gsm8k"] and isinstance(interactions["gsm8k"],
                                                         Gsm8kInteraction)
    assert "verl's verl.interactions.gsm8k_interaction.Gsm8kInteraction runs as Relay's" \
        in caplog.text


def test_the_gsm8k_user_says_whether_the_last_answer_is_right() -> None:
    user = Gsm8kInteraction({})

    async def talk() -> list[tuple[bool, str, float, dict]]:
        instance = await user.start_interaction(None, ground_truth="72")
        wrong = await user.generate_response(instance, [
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "It is 70."}])
        right = await user.generate_response(instance, [
            {"role": "assistant", "content": "70"}, {"role": "user", "content": "no"},
            {"role": "assistant", "content": "So #### 72"}])
        await user.finalize_interaction(instance)
        return [wrong, right]

    wrong, right = asyncio.run(talk())
    assert wrong[:3] == (False, "Your response is incorrect! You need to reflect on your "
                                "answer and try again.", 0.0)
    assert right[:3] == (True, "Your response is correct!", 1.0)


def test_a_users_own_interaction_by_file_path(tmp_path: Path) -> None:
    (tmp_path / "users.py").write_text(
        "from relay.generators.tools.interaction import BaseInteraction\n"
        "class Stubborn(BaseInteraction):\n"
        "    async def generate_response(self, instance_id, messages, **kwargs):\n"
        "        return False, 'again', 0.0, {}\n")
    path = tmp_path / "interaction.yaml"
    path.write_text(f"interaction:\n  - name: stubborn\n"
                    f"    class_name: {tmp_path / 'users.py'}:Stubborn\n")
    (user,) = load_interactions(path).values()
    assert isinstance(user, BaseInteraction) and user.name == "stubborn"


@pytest.mark.parametrize(("text", "message"), [
    ("tools: []\n", "expected a mapping with a non-empty 'interaction' list"),
    ("interaction:\n  - name: a\n    class_name: x.Y\n    extra: 1\n",
     "interaction[0]: unknown keys ['extra']"),
    ("interaction:\n  - name: a\n    class_name: collections.OrderedDict\n",
     "interaction[0].class_name: collections.OrderedDict is not a subclass of "
     "relay.generators.tools.interaction.BaseInteraction"),
    ("interaction:\n  - {name: a, class_name: " + "verl.interactions.gsm8k_interaction."
     "Gsm8kInteraction}\n  - {name: a, class_name: " + "verl.interactions.gsm8k_interaction."
     "Gsm8kInteraction}\n", "interaction[1].name: 'a' is already used"),
    ("interaction: [\n", "not valid YAML"),
])
def test_a_bad_interaction_config_is_refused_naming_where(tmp_path: Path, text: str,
                                                          message: str) -> None:
    path = tmp_path / "interaction.yaml"
    path.write_text(text)
    with pytest.raises(ToolConfigError, match=None) as error:
        load_interactions(path)
    assert str(error.value).startswith(str(path)) and message in str(error.value)
