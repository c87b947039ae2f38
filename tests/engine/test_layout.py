"""grpo/engine/layout.py: the packed row [prompt; completion_1; ...] of each group, and what predicts what."""
import torch

from grpo.engine.layout import build_layout


def test_each_prompt_once_then_its_completions_with_their_own_positions():
    lay = build_layout([[11, 12, 13]], [[[21, 22], [31]]], torch.device("cpu"))
    assert lay.input_ids.tolist() == [[11, 12, 13, 21, 22, 31]] and lay.n_tokens == 6
    assert lay.position_ids.tolist() == [[0, 1, 2, 3, 4, 3]]  # every completion continues the prompt
    assert lay.targets.tolist() == [21, 22, 31]
    packed = lay.input_ids[0]
    # the last prompt token predicts each completion's first token; then each token its next one
    assert packed[lay.pred_idx].tolist() == [13, 21, 13]
    assert lay.max_seq_len == 5
