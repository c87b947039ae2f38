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


def spans(prompts, completions):
    """[(start, end, start of the group's prompt)] of every prompt and completion in the packed row."""
    out, t = [], 0
    for p, comps in zip(prompts, completions):
        p0 = t
        for n in [len(p)] + [len(r) for r in comps]:
            out.append((t, t + n, p0))
            t += n
    return out


def test_segments_name_each_prompt_and_completion_once_across_three_groups():
    """Three groups of ragged sizes (G = 1, 3, 2: a full group before another; one-token prompts and completions):
    tokens share a segment id exactly when they belong to the same prompt or completion, and each token's prompt
    segment is its group's prompt's id; every slot index points back at its token."""
    prompts = [[1, 2], [3], [4, 5, 6]]
    completions = [[[7]], [[11], [12, 13], [14]], [[8, 9], [10]]]
    lay = build_layout(prompts, completions, torch.device("cpu"))
    seg, pseg = lay.segment.tolist(), lay.prompt_segment.tolist()
    owner = [k for k, (a, b, _) in enumerate(spans(prompts, completions)) for _ in range(a, b)]
    assert len(seg) == len(pseg) == len(owner) == lay.n_tokens == 14 and min(seg) >= 0  # flex pads with -1
    assert all((seg[i] == seg[j]) == (owner[i] == owner[j]) for i in range(14) for j in range(14))
    assert pseg == [seg[p0] for a, b, p0 in spans(prompts, completions) for _ in range(a, b)]
    assert (lay.max_prompt, lay.max_group, lay.max_completion, lay.max_seq_len) == (3, 3, 2, 5)
    assert lay.prompt_valid.tolist() == [[True, True, False], [True, False, False], [True, True, True]]
    ids = lay.input_ids[0]
    slots = torch.cat([lay.prompt_idx, lay.comp_idx])  # prompt slots, then completion slots
    assert slots[lay.src].tolist() == list(range(14))  # every token's slot holds that token
    assert lay.prompt_idx.tolist() == [0, 1, 0, 3, 0, 0, 8, 9, 10]  # padding slots: 0
    assert lay.comp_idx.tolist() == [2, 0, 0, 0, 0, 0, 4, 0, 5, 6, 7, 0, 11, 12, 13, 0, 0, 0]
    assert ids[lay.prompt_idx.view(3, 3)[lay.prompt_valid]].tolist() == [1, 2, 3, 4, 5, 6]
    comp = lay.comp_idx.view(3, 3, 2)
    assert [ids[comp[b, i, :len(r)]].tolist() for b, c in enumerate(completions) for i, r in enumerate(c)] == \
        [r for c in completions for r in c]
    assert ids[lay.pred_idx].tolist() == [2, 3, 3, 12, 3, 6, 8, 6]


def test_a_row_of_one_token():
    """A one-token prompt with an empty completion: one token, one segment, nothing to predict."""
    lay = build_layout([[5]], [[[]]], torch.device("cpu"))
    assert lay.input_ids.tolist() == [[5]] and lay.position_ids.tolist() == [[0]]
    assert (lay.n_tokens, lay.max_prompt, lay.max_group, lay.max_completion, lay.max_seq_len) == (1, 1, 1, 1, 1)
    assert lay.prompt_valid is None and lay.src.tolist() == [0] and lay.prompt_idx.tolist() == [0]
    assert lay.comp_idx.tolist() == [0]  # the padded completion slot points at a token that exists
    assert lay.segment.tolist() == lay.prompt_segment.tolist() == [0]
    assert lay.pred_idx.numel() == lay.targets.numel() == 0
    assert lay.pred_idx.dtype == lay.targets.dtype == torch.long  # index tensors, also when empty
