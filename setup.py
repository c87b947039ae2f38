"""The package carries its configs: a built wheel gets the checkout's configs/ (recipes included, through the
configs/recipe -> ../recipes link) as grpo/_data/configs, where grpo/config/compose.py looks first. An editable install
reads configs/ and recipes/ in place (no copy: one source of truth). Everything else is in pyproject.toml."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithConfigs(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        target = Path(self.build_lib) / "grpo" / "_data" / "configs"
        shutil.rmtree(target, ignore_errors=True)
        # symlinks=False: the recipe group is copied as files (a wheel keeps no links)
        shutil.copytree(Path(__file__).parent / "configs", target, ignore=shutil.ignore_patterns("__pycache__"))


setup(cmdclass={"build_py": BuildWithConfigs})
