"""scripts/probe_tools.py (docs/recipes.md's calculator-tools measurements), scaled down: the trainer's turn loop
on the tiny model, in this process, one JSON line per variant with rates that count its episodes."""
import importlib.util
import json

from tests.helpers import ROOT


def test_probe_tools_reports_each_variant_over_its_episodes(capsys):
    spec = importlib.util.spec_from_file_location("probe_tools", ROOT / "scripts" / "probe_tools.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.main(["--model", "tiny:llama", "--variants", "code-shot,pythonic", "--prompts", "2", "--group", "2",
                       "--new", "6", "--show", "1"]) == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert [(r["variant"], r["format"], r["episodes"]) for r in lines] == [("code-shot", "code", 4),
                                                                         ("pythonic", "pythonic", 4)]
    for r in lines:
        assert r["prompt_tokens"] > 0
        for key in ("call_rate", "right_call_rate", "accuracy"):  # fractions of the 4 episodes
            assert r[key] * 4 == round(r[key] * 4) and 0 <= r[key] <= 1, (key, r)
        assert r["zero_std_frac"] in (0.0, 0.5, 1.0)  # of 2 groups
        assert r["right_call_rate"] <= r["call_rate"]
