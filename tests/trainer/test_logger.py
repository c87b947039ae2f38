"""grpo/trainer/logger.py: metrics.jsonl read back while a run writes it; the console's reward curve."""
from grpo.trainer.logger import ascii_curve, read_metrics


def test_a_half_written_last_line_is_skipped(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    assert read_metrics(p) == [{"step": 1, "loss": 0.5}] and read_metrics(tmp_path / "none.jsonl") == []


def test_the_curve_spans_the_values():
    text = ascii_curve([0.0, 0.5, 1.0], label="reward_mean")
    assert "1.000 |" in text and "0.000 |" in text and "reward_mean over 3 steps" in text
    assert ascii_curve([None]) == ""


def test_one_step_is_one_step():
    from grpo.trainer.logger import ascii_curve

    assert ascii_curve([0.5]).endswith("reward over 1 step")
    assert ascii_curve([0.5, 0.7]).endswith("reward over 2 steps")
