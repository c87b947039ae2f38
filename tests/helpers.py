"""Shared test helpers: compose recipes with Hydra exactly as the command line does."""
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from grpo.cli import CONFIG_DIR

ROOT = Path(__file__).resolve().parent.parent


def compose_recipe(recipe: str, overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[f"recipe={recipe}", *(overrides or [])])
    return cfg


def smoke_raw():
    cfg = compose_recipe("smoke")
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
