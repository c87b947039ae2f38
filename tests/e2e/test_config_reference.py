"""docs/config-reference.md is generated from the schema; it must match what the generator writes now."""
import subprocess
import sys

from grpo.config.schema import schema_keys
from tests.helpers import ROOT, load_script

config_docs = load_script("gen_config_docs")


def test_committed_reference_is_up_to_date():
    committed = (ROOT / "docs" / "config-reference.md").read_text()
    assert committed == config_docs.render(), \
        "docs/config-reference.md is out of date; regenerate it: python scripts/gen_config_docs.py"


def test_every_schema_key_is_documented_with_a_meaning():
    text = (ROOT / "docs" / "config-reference.md").read_text()
    rows = {r["key"]: r for r in config_docs.rows()}
    assert set(rows) == set(schema_keys())
    for key in schema_keys():
        assert f"| `{key}` |" in text, key
        assert rows[key]["meaning"], f"{key} has no comment in grpo/config/schema.py"


def test_groups_and_recipes_are_listed():
    text = (ROOT / "docs" / "config-reference.md").read_text()
    for group, paths in config_docs.group_options().items():
        for p in paths:
            assert f"| `{group}` | `{p.stem}` |" in text
    for p in (ROOT / "recipes").glob("*.yaml"):
        assert f"| `{p.stem}` |" in text


def test_comments_are_read_from_the_source():
    src = '''
class A:
    # first line
    # second line
    x: int = 1  # inline
    y: str = "a#b"          # after a string holding a hash
    z: int = 3
'''
    got = config_docs.field_comments(src)
    assert got[("A", "x")] == "first line second line inline"
    assert got[("A", "y")] == "after a string holding a hash"
    assert got[("A", "z")] == ""


def test_check_mode(tmp_path):
    stale = tmp_path / "ref.md"
    stale.write_text("old\n")
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check", "--out", str(stale)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "out of date" in p.stderr
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--out", str(stale)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and stale.read_text() == config_docs.render()
