"""Counting shapes in a picture: ``How many red squares are in the image?`` with an integer answer.

Each image is drawn from the seed alone (no files, no download): ``size`` x ``size`` pixels on white, up to
``max_shapes`` shapes (square, circle, triangle) in red, green or blue, each in its own cell of a grid (so they
never overlap), the asked one 0 to 3 times. The row carries the image under ``images`` (a list of one PIL image)
and the prompt as a conversation whose user turn holds an ``{"type": "image"}`` part, TRL's format; the answer is
scored by the ``arithmetic`` reward like any integer answer.
"""
from __future__ import annotations

import random

from grpo.tasks import register_task

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220)}
KINDS = ("square", "circle", "triangle")


def draw(rng: random.Random, size: int, shapes: list[tuple[str, str]]):
    """An RGB image of ``shapes`` ((colour, kind) pairs), each in its own cell of a grid (no overlap), at random
    cells; a shape is ``size // 5`` pixels wide."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), "white")
    pen = ImageDraw.Draw(img)
    r, per_side = cell_grid(size)
    cell = size // per_side
    for (colour, kind), at in zip(shapes, rng.sample(range(per_side * per_side), len(shapes))):
        x, y = (at % per_side) * cell + cell // 2, (at // per_side) * cell + cell // 2
        fill = COLOURS[colour]
        if kind == "square":
            pen.rectangle([x - r, y - r, x + r, y + r], fill=fill)
        elif kind == "circle":
            pen.ellipse([x - r, y - r, x + r, y + r], fill=fill)
        else:
            pen.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)
    return img


def cell_grid(size: int) -> tuple[int, int]:
    """(shape radius, cells per side) of a ``size`` x ``size`` picture."""
    r = max(2, size // 10)
    return r, size // (2 * r + 2)


def shapes(n: int, seed: int, size: int = 32, max_shapes: int = 4,
           template: str = "How many {colour} {kind}s are in the image? Answer with the number only.") -> list[dict]:
    """``n`` pictures, deterministic in ``seed``; the asked (colour, kind) appears 0-3 times among ``max_shapes``."""
    if size < 16:
        raise ValueError(f"size must be at least 16 pixels, got {size}")
    if not 1 <= max_shapes <= cell_grid(size)[1] ** 2:
        raise ValueError(f"max_shapes must be 1-{cell_grid(size)[1] ** 2} for size {size}, got {max_shapes}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        colour, kind = rng.choice(list(COLOURS)), rng.choice(KINDS)
        count = rng.randint(0, min(3, max_shapes))
        others = [(c, k) for c in COLOURS for k in KINDS if (c, k) != (colour, kind)]
        drawn = [(colour, kind)] * count + [rng.choice(others) for _ in range(rng.randint(0, max_shapes - count))]
        rng.shuffle(drawn)
        question = template.format(colour=colour, kind=kind)
        rows.append({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                     "images": [draw(rng, size, drawn)], "answer": count})
    return rows


# registered by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
register_task("shapes")(shapes)
