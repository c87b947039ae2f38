"""Entry point: ``grpo-train recipe=NAME key=value ...`` or ``python -m grpo.train ...``.

The command line is composed and its schema checked (grpo/cli.py, grpo/config/schema.py) before the training loop
(grpo/trainer/loop.py), and with it torch, is imported: a mistake there costs one line, not torch's start-up.
"""
from __future__ import annotations

import os
import sys
from dataclasses import asdict

from grpo.config.schema import Config, load
from grpo.errors import GRPOError, show_warnings_as_lines


def _hydra_main():
    import hydra
    from omegaconf import DictConfig

    from grpo.config.compose import CONFIG_DIR

    def _run(raw: DictConfig) -> float | None:
        from hydra import compose as hydra_compose
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf

        from grpo.cli import expand_paths
        from grpo.config.compose import apply_precedence
        from grpo.trainer.loop import fit  # torch and the models: only for a config that passed its checks

        hc = HydraConfig.get()
        run_dir = hc.runtime.output_dir
        try:
            raw = apply_precedence(raw, list(hc.overrides.task), OmegaConf.to_container(hc.runtime.choices),
                                   lambda ov: hydra_compose(config_name="config", overrides=ov))
        except GRPOError as e:
            _fail(e, run_dir)
        if not expand_paths(raw.trainer):  # a sweep's job: its own directory (grpo/cli.py `_sweep_dir`)
            raw.trainer.output_dir = run_dir
        cfg = _load_or_exit(OmegaConf.to_container(raw, resolve=True), run_dir)
        saved = os.path.join(hc.runtime.output_dir, hc.output_subdir or "", "config.yaml")
        if hc.output_subdir and os.path.isdir(os.path.dirname(saved)):  # the config that runs, not Hydra's merge
            OmegaConf.save(OmegaConf.create(asdict(cfg)), saved)
        from grpo.trainer.logger import run_log
        from grpo.trainer.signals import StopNow

        with run_log(cfg.trainer.output_dir, enabled=int(os.environ.get("RANK") or 0) == 0):  # errors too
            try:
                result = fit(cfg)
            except (GRPOError, FileNotFoundError) as e:
                _fail(e, run_dir)
            except StopNow as e:  # a second Ctrl-C / SIGTERM: the one line it printed is all
                sys.exit(e.exit_code)
            except KeyboardInterrupt:  # before the loop's signal handlers (loading the model, ...)
                _interrupted(run_dir)
        after = result.get("eval_after", {})
        return after.get("reward_mean")

    # wrapped by a call, not decorated: mutmut 3 mutates no decorated function (tests/e2e/test_mutation_setup.py);
    # Hydra's arguments are read by a Hydra run only (tests/test_cli.py's), not by the unit tests `make mutate` runs
    main = hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base=None)  # pragma: no mutate
    return main(_run)


def _load_or_exit(raw: dict, run_dir: str) -> Config:
    try:
        return load(raw)
    except GRPOError as e:
        _fail(e, run_dir)


def _fail(e: Exception, run_dir: str | None = None):
    """A GRPOError (or a missing file) as one line, ``error: <message>``, exit code 2; with HYDRA_FULL_ERROR=1
    the traceback. A run directory that holds nothing but what Hydra wrote into it is removed."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise e
    print(f"error: {e}", file=sys.stderr, flush=True)
    _drop_empty_run_dir(run_dir)
    if int(os.environ.get("WORLD_SIZE") or 1) > 1:
        # one of many processes: exit now, without the interpreter's teardown (destroying the process group,
        # library atexit hooks), which may wait on ranks still blocked in a collective; the launcher then
        # stops the others
        sys.stdout.flush()
        os._exit(2)
    sys.exit(2)


def _interrupted(run_dir: str | None = None):
    """Ctrl-C before training began (checks, imports, loading the model): one line, exit code 130 as a shell's."""
    print("\n[grpo] interrupted (Ctrl-C) while starting; nothing was trained", file=sys.stderr, flush=True)
    _drop_empty_run_dir(run_dir)
    sys.exit(130)


def _drop_empty_run_dir(run_dir: str | None) -> None:
    """Hydra creates the run directory before the run starts: an error then must not leave one holding only
    ``.hydra/`` (and Hydra's ``train.log``). Never the working directory, never one holding anything else."""
    import shutil

    if not run_dir or int(os.environ.get("RANK") or 0) > 0 or not os.path.isdir(run_dir):
        return
    if os.path.abspath(run_dir) != os.getcwd() and set(os.listdir(run_dir)) <= {".hydra", "train.log"}:
        shutil.rmtree(run_dir, ignore_errors=True)
        parent = os.path.dirname(os.path.abspath(run_dir))
        while parent.startswith(os.getcwd() + os.sep) and not os.listdir(parent):  # outputs/<date>/, emptied
            os.rmdir(parent)
            parent = os.path.dirname(parent)


def main() -> None:
    from grpo.cli import prepare_argv

    show_warnings_as_lines()
    try:
        sys.argv = prepare_argv(sys.argv)
        _hydra_main()()
    except GRPOError as e:
        _fail(e)
    except KeyboardInterrupt:  # in the checks before Hydra or in Hydra's set-up
        _interrupted()


if __name__ == "__main__":
    main()
