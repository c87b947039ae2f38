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


def test_the_working_directory_goes_on_the_path_once_and_only_where_it_is_not_importable(tmp_path, monkeypatch):
    import os
    import sys

    (tmp_path / "objmod_once.py").write_text("VALUE = 7\n")
    monkeypatch.chdir(tmp_path)
    rest = [p for p in sys.path if p not in ("", os.getcwd())]
    monkeypatch.setattr(sys, "path", [os.getcwd(), *rest])  # already there: not added again
    assert import_attr("objmod_once", "VALUE") == 7 and sys.path.count(os.getcwd()) == 1
    monkeypatch.setattr(sys, "path", ["", *rest])  # "" is the working directory already: nothing added
    import_attr("os", "sep")
    assert os.getcwd() not in sys.path


def test_the_first_colon_ends_the_module_name():
    with pytest.raises(ConfigError, match=r"^k='os:path:sep': module 'os' has no 'path:sep'$"):
        load_object("os:path:sep", "k")
