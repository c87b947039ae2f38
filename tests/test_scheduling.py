"""tests/conftest.py's order of the suite: the longest scheduling units first (by tests/durations.json), a group's
tests together and in their order, so that `make test`'s two workers end together."""
from tests.conftest import DURATIONS, TOGETHER, UNKNOWN_SLOW_S, _scope, longest_first, merge_durations


def test_longest_units_first_a_group_kept_together_and_new_slow_tests_early():
    items = ["g::a", "quick", "g::b", "long", "new_slow", "tie", "g::c"]

    def unit(item):
        return item.split("::")[0]

    recorded = {"g": 20.0, "long": 90.0, "quick": 0.1}
    order = longest_first(items, unit, recorded, slow={"new_slow"})
    assert order == ["long", "new_slow", "g::a", "g::b", "g::c", "quick", "tie"]  # 90, 30 (unknown slow), 20, ...
    # a group and a test of the same cost: the group's tests stay together, in collection order
    assert longest_first(items, unit, {}, slow=set()) == ["g::a", "g::b", "g::c", "quick", "long", "new_slow", "tie"]
    assert UNKNOWN_SLOW_S > recorded["g"]


def test_the_recorded_durations_name_units_of_this_suite():
    import json

    recorded = json.loads(DURATIONS.read_text())
    assert recorded and all(s >= 0 for s in recorded.values())
    groups = [unit for unit in recorded if "::" not in unit]
    assert set(groups) <= set(TOGETHER)  # a group's tests are recorded under its name, not one by one
    assert _scope("tests/e2e/test_multinode.py::x") == "multinode"


def test_recording_merges_this_runs_times_over_the_file(tmp_path):
    import json

    path = tmp_path / "durations.json"
    merge_durations(path, {"a::t": 1.234, "g": 10.0})
    merge_durations(path, {"g": 12.005, "b::t": 0.5})  # a run of some tests only: the others keep their times
    assert json.loads(path.read_text()) == {"a::t": 1.23, "b::t": 0.5, "g": 12.01}
