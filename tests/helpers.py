"""Shared test helpers: compose recipes with Hydra exactly as the command line does."""
from pathlib import Path

from omegaconf import OmegaConf

from grpo.compose import compose

ROOT = Path(__file__).resolve().parent.parent


def compose_recipe(recipe: str, overrides: list[str] | None = None):
    """The config the command line ``recipe=<recipe> <overrides>`` trains with (without Hydra's own section)."""
    cfg = compose([f"recipe={recipe}", *(overrides or [])])
    return OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])


def smoke_raw():
    cfg = compose_recipe("smoke")
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
