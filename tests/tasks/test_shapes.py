"""builtin:shapes: seeded pictures of coloured shapes whose answer is the count the picture shows."""
import numpy as np
import pytest

from grpo.rewards import resolve
from grpo.tasks import get_task
from grpo.tasks.shapes import COLOURS, cell_grid


def _count(img, colour: str, kind: str, size: int) -> int:
    """The shapes of ``colour`` and ``kind`` read back from the pixels: a cell's filled-pixel count tells the kind."""
    a = np.asarray(img)
    r, per_side = cell_grid(size)
    cell = size // per_side
    full = (2 * r + 1) ** 2
    found = 0
    for at in range(per_side * per_side):
        y, x = (at // per_side) * cell, (at % per_side) * cell
        block = a[y:y + cell, x:x + cell].reshape(-1, 3)
        filled = (block == COLOURS[colour]).all(-1).sum()
        if not filled:
            continue
        seen = "square" if filled == full else "circle" if filled > 0.6 * full else "triangle"
        found += seen == kind
    return found


def test_answer_is_what_the_picture_shows():
    rows = get_task("shapes")(60, seed=1)
    assert {r["answer"] for r in rows} == {0, 1, 2, 3}
    for r in rows:
        words = r["prompt"][0]["content"][1]["text"].split()
        colour, kind = words[2], words[3][:-1]
        assert _count(r["images"][0], colour, kind, 32) == r["answer"]
        assert r["prompt"][0]["content"][0] == {"type": "image"}


def test_deterministic_in_seed_and_scored_by_the_integer_reward():
    make = get_task("shapes")
    a, b, c = make(5, seed=3), make(5, seed=3), make(5, seed=4)
    def pixels(rows):
        return [np.asarray(r["images"][0]).tobytes() for r in rows]

    assert pixels(a) == pixels(b) and pixels(a) != pixels(c)
    assert [r["answer"] for r in a] == [r["answer"] for r in b]
    right, wrong = str(a[0]["answer"]), str(a[0]["answer"] + 1)
    rewards = resolve("arithmetic")([""] * 2, [right, wrong], answer=[a[0]["answer"]] * 2)
    assert rewards[0] > rewards[1]
    big = make(3, seed=0, size=64, max_shapes=9)
    assert big[0]["images"][0].size == (64, 64)
    with pytest.raises(ValueError, match="max_shapes must be 1-16"):
        make(1, seed=0, max_shapes=17)
