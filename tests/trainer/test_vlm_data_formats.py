"""An image dataset in each of the three usual formats trains (tiny:qwen2_5_vl, one step, in process), and a prompt
that places images in a row without them is one line before any model loads (docs/vision-language.md, "Data").

- Hugging Face datasets: a Parquet file written by `datasets` with an ``Image`` feature (load_dataset gives PIL);
- TRL: JSONL, conversational prompts with ``{"type": "image"}`` parts, images as file paths;
- verl: Parquet, an ``images`` column of ``{"bytes", "path"}`` dicts and ``<image>`` markers in the text."""
import json

import pytest
from omegaconf import OmegaConf

from grpo.config.schema import load
from grpo.errors import DataError
from grpo.tasks import get_task
from grpo.trainer.loop import fit
from tests.helpers import compose_recipe, count_tower_patches


def _rows():
    return get_task("shapes")(4, seed=3)


def _hf(tmp_path):
    import datasets

    rows = [{"prompt": r["prompt"][0]["content"][1]["text"], "image": r["images"][0], "answer": r["answer"]}
            for r in _rows()]
    features = datasets.Features({"prompt": datasets.Value("string"), "image": datasets.Image(),
                                  "answer": datasets.Value("int64")})
    path = tmp_path / "hf.parquet"
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(path))
    # a plain question (no parts, no marker) and one image: the image goes before the text
    return path, ["data.image_column=image"]


def _trl(tmp_path):
    path = tmp_path / "trl.jsonl"
    lines = []
    for i, r in enumerate(_rows()):
        r["images"][0].save(tmp_path / f"{i}.png")
        lines.append(json.dumps({"prompt": r["prompt"], "images": [str(tmp_path / f"{i}.png")], "answer": r["answer"]}))
    path.write_text("\n".join(lines) + "\n")
    return path, []


def _verl(tmp_path):
    import io

    import datasets

    rows = []
    for r in _rows():
        buf = io.BytesIO()
        r["images"][0].save(buf, format="PNG")
        rows.append({"prompt": [{"role": "user", "content": "<image>" + r["prompt"][0]["content"][1]["text"]}],
                     "images": [{"bytes": buf.getvalue(), "path": None}], "answer": r["answer"]})
    path = tmp_path / "verl.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path, []


def _cfg(tmp_path, path, extra):
    cfg = compose_recipe("vlm-smoke", [f"trainer.output_dir={tmp_path / 'run'}", f"data.source={path}",
                                       "data.num_train=4", "data.num_eval=0", "trainer.max_steps=1", *extra])
    return load(OmegaConf.to_container(cfg, resolve=True))


@pytest.mark.parametrize("make", [_hf, _trl, _verl], ids=["hf-datasets-image", "trl-parts", "verl-images"])
def test_an_image_dataset_in_each_format_trains(tmp_path, make, monkeypatch):
    patches = count_tower_patches(monkeypatch)
    path, extra = make(tmp_path)
    fit(_cfg(tmp_path, path, extra))
    rows = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == [1] and rows[0]["grad_norm"] > 0
    assert patches and set(patches) <= {64, 128}  # the 32x32 pictures went through the tower (64 patches each)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert all(s["prompt"].startswith("user: <|vision_start|><|image_pad|><|vision_end|>How many") for s in samples)


def test_a_prompt_placing_images_without_its_image_column_is_one_line(tmp_path, monkeypatch):
    import grpo.trainer.build

    path, _ = _trl(tmp_path)
    monkeypatch.setattr(grpo.trainer.build, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(DataError, match="data row 0: its prompt places 1 image\\(s\\) but the row has no images in "
                                        "data.image_column='image'; its columns are: prompt, images, answer"):
        fit(_cfg(tmp_path, path, ["data.image_column=image"]))
    assert not (tmp_path / "run").exists()
