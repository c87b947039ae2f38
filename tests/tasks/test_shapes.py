"""builtin:shapes: seeded pictures of coloured shapes whose answer is the count the picture shows."""
import re

import numpy as np
import pytest

from grpo.rewards import resolve
from grpo.tasks import get_task
from grpo.tasks.shapes import COLOURS, cell_grid, draw


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


class At:
    """An rng whose `sample` places the shapes at the given cells."""

    def __init__(self, *cells):
        self.cells = list(cells)

    def sample(self, population, k):
        assert len(population) >= k == len(self.cells)
        return self.cells


def _box(img, colour):
    """(left, top, right, bottom) of the pixels of ``colour``, inclusive, and the filled width of each row."""
    mask = (np.asarray(img) == COLOURS[colour]).all(-1)
    ys, xs = np.nonzero(mask)
    rows = [int(mask[y].sum()) for y in range(ys.min(), ys.max() + 1)]
    return (xs.min(), ys.min(), xs.max(), ys.max()), rows


@pytest.mark.parametrize("size", [32, 50])
def test_each_shape_is_centred_in_its_cell_on_white(size):
    r, per_side = cell_grid(size)
    cell = size // per_side
    at = per_side * 2 + per_side - 1   # the third row's last cell: cell widths add up across the picture
    img = draw(At(at), size, [("green", "square")])
    x, y = (per_side - 1) * cell + cell // 2, 2 * cell + cell // 2
    box, rows = _box(img, "green")
    assert box == (x - r, y - r, x + r, y + r) and set(rows) == {2 * r + 1}
    a = np.asarray(img)
    assert (a == 255).all(-1).sum() == size * size - (2 * r + 1) ** 2   # every other pixel is white


def test_a_triangle_points_up_from_a_base_as_wide_as_the_square_and_a_circle_is_round():
    r, per_side = cell_grid(32)
    img = draw(At(0, 5), 32, [("blue", "triangle"), ("red", "circle")])
    (left, top, right, bottom), rows = _box(img, "blue")
    assert (right - left, bottom - top) == (2 * r, 2 * r)
    assert rows[0] <= 2 and rows[-1] == 2 * r + 1 and rows == sorted(rows)  # widening from the apex to the base
    (left, top, right, bottom), rows = _box(img, "red")
    assert (right - left, bottom - top) == (2 * r, 2 * r) and rows == rows[::-1] and rows[0] < max(rows)


def test_the_grid_leaves_every_shape_a_cell_and_small_pictures_shapes_five_pixels_wide():
    assert cell_grid(16) == (2, 2) and cell_grid(20) == (2, 3) and cell_grid(32) == (3, 4)
    assert cell_grid(64) == (6, 4)
    (left, _, right, _), _ = _box(draw(At(3), 16, [("red", "square")]), "red")
    assert right - left + 1 == 5


def _occupied(img, size):
    """How many cells of the grid hold a shape (any pixel that is not white)."""
    a = np.asarray(img)
    r, per_side = cell_grid(size)
    cell = size // per_side
    return sum(bool((a[y:y + cell, x:x + cell] != 255).any()) for y in range(0, per_side * cell, cell)
               for x in range(0, per_side * cell, cell))


def test_a_row_is_one_user_turn_with_the_image_and_the_question_among_at_most_max_shapes():
    rows = get_task("shapes")(80, seed=2)
    counts = []
    for r in rows:
        (turn,) = r["prompt"]
        question = turn["content"][1]["text"]
        assert r["prompt"] == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        assert re.fullmatch(r"How many (red|green|blue) (square|circle|triangle)s are in the image\? Answer with "
                            r"the number only\.", question)
        assert r["images"][0].size == (32, 32)
        counts.append(_occupied(r["images"][0], 32))
    assert max(counts) == 4 and min(counts) == 0  # up to max_shapes (4); a picture of the asked count alone
    assert any(c == r["answer"] > 0 for c, r in zip(counts, rows))
    for size, max_shapes in ((16, 4), (32, 1), (32, 16)):
        (row,) = get_task("shapes")(1, seed=0, size=size, max_shapes=max_shapes)
        assert row["images"][0].size == (size, size) and _occupied(row["images"][0], size) <= max_shapes
    with pytest.raises(ValueError, match="size must be at least 16 pixels, got 15"):
        get_task("shapes")(1, seed=0, size=15)
    with pytest.raises(ValueError, match="max_shapes must be 1-16 for size 32, got 0"):
        get_task("shapes")(1, seed=0, max_shapes=0)
