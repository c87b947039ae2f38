"""grpo/objects.py: the one module:attr loader; its errors name the key."""
import pytest

from grpo.errors import ConfigError
from grpo.objects import import_attr, load_object


def test_loads_from_beside_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "objmod_xyz.py").write_text("VALUE = 41\n")
    monkeypatch.chdir(tmp_path)
    assert load_object("objmod_xyz:VALUE", "k") == 41 and import_attr("objmod_xyz", "nope") is None


@pytest.mark.parametrize("spec,why", [("no_colon", "must be 'package.module:name'"),
                                      ("missing_mod_xyz:f", "cannot import module"), ("os:nope_xyz", "has no")])
def test_a_bad_name_is_one_line_naming_the_key(spec, why):
    with pytest.raises(ConfigError, match=f"rollout.environment={spec!r}.*{why}|{why}"):
        load_object(spec, "rollout.environment")
