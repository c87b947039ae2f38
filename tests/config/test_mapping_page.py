"""docs/coming-from-trl-verl.md, the mapping a TRL or verl user reads: every key of ours its tables name is a key of
the schema, every `key=value` of ours is a value the schema takes, and a key's listed choices are all its choices
(the vLLM server mode was once missing from it)."""
import re

import pytest

from grpo.config.schema import _CHOICES, open_dict_keys, schema_keys
from grpo.config.theirs import THEIRS, ours_for
from grpo.rollout.registry import BACKENDS
from tests.helpers import ROOT

PAGE = (ROOT / "docs" / "coming-from-trl-verl.md").read_text()
SECTIONS = ("model", "data", "reward", "rollout", "algorithm", "engine", "trainer", "logging", "distributed")


def ours() -> list[str]:
    """The code spans of the tables' second column (ours) that are dotted keys of a config section."""
    cells = [row.split("|")[2] for row in PAGE.splitlines() if row.startswith("|") and row.count("|") >= 4]
    spans = [s for cell in cells for s in re.findall(r"`([^`]+)`", cell)]
    return [s for s in spans if re.match(rf"({'|'.join(SECTIONS)})\.[a-z_.]+(=|$)", s)]


def test_every_key_of_ours_the_page_names_exists_and_takes_the_value_shown():
    keys, opens = set(schema_keys()), open_dict_keys()
    named = ours()
    assert len(named) > 40  # the tables were read
    for span in named:
        key, _, value = span.partition("=")
        assert key in keys or any(key.startswith(d + ".") for d in opens), span
        if value and key in _CHOICES:
            assert value in _CHOICES[key], span


def test_the_backend_row_lists_every_backend_and_server_mode_is_mapped():
    row = next(r for r in PAGE.splitlines() if r.startswith("| `actor_rollout_ref.rollout.name`"))
    listed = re.findall(r"`(\w+)`", row.split("|")[2].split("rollout.backend", 1)[1])
    ours = [n for n in BACKENDS if str(getattr(BACKENDS[n].make, "__module__", BACKENDS[n].make)).startswith("grpo.")]
    assert sorted(listed) == sorted(["auto", *ours])  # every backend grpo registers (not a test's toy one)
    trl = next(r for r in PAGE.splitlines() if r.startswith('| `vllm_mode="server"`'))
    assert "`rollout.backend=server`" in trl.split("|")[2] and "no server mode" not in PAGE


# ------------------------------------------------------------------------- grpo/config/theirs.py: their values, ours
@pytest.mark.parametrize("key, value, tail", [
    ("algorithm.kl_estimator", "low_var_kl", "; verl's low_var_kl is algorithm.kl_estimator=k3 here"),
    ("algorithm.kl_estimator", "MSE", "; verl's mse is algorithm.kl_estimator=k2 here"),  # any case
    ("algorithm.kl_estimator", "kl", "; verl's kl is algorithm.kl_estimator=k1 here"),
    ("algorithm.scale_rewards", False, "; TRL's false is algorithm.scale_rewards=none here"),  # YAML's false
    ("algorithm.scale_rewards", "True", "; TRL's true is algorithm.scale_rewards=group here"),
    ("algorithm.kl_estimator", "abs", ""),   # theirs, but nothing of ours means it
    ("algorithm.loss_agg", "low_var_kl", ""),  # their value of another key
])
def test_ours_for_names_our_value_for_theirs_and_nothing_else(key, value, tail):
    assert ours_for(key, value) == tail


def test_their_values_are_the_pages_and_ours_are_choices_of_the_key():
    for key, values in THEIRS.items():
        for theirs, (our, whose) in values.items():
            assert our in _CHOICES[key] and whose in ("TRL's", "verl's"), (key, theirs)
            row = next(r for r in PAGE.splitlines() if r.startswith("|") and r.count("|") >= 4
                       and f"`{key}`" in r.split("|")[2] and theirs in r.split("|")[1].lower())
            assert f"`{our}`" in row, (key, theirs)
