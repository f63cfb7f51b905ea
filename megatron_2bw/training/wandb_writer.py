"""Weights & Biases logging with Megatron-LM's flags: ``--wandb-project``, ``--wandb-exp-name``, ``--wandb-save-dir``.

As in Megatron, ``--wandb-project`` turns it on, the experiment name is required with it, and
the run directory defaults to ``<--save>/wandb``. The mode is ``$WANDB_MODE`` when set, else
``online`` when ``$WANDB_API_KEY`` is set, else ``offline``: a machine without an account or a
network still records the run, and ``wandb sync <run dir>`` uploads it later. Only the rank
that holds ``Metrics`` (global rank 0, which receives every number already reduced) creates
a writer. ``wandb`` is an install extra (``pip install -e '.[wandb]'``); a missing package
is a one-line error checked before any process group exists (:func:`require_wandb`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from .tb_writer import finite_scalars

log = logging.getLogger("megatron_2bw")

INSTALL_HINT = "pip install -e '.[wandb]'"


@dataclass(frozen=True)
class WandbSettings:
    """Resolved flags: project, run name, the directory wandb writes under, and the mode."""

    project: str
    exp_name: str
    save_dir: str
    mode: str


def wandb_mode(env: Mapping[str, str] | None = None) -> str:
    """``$WANDB_MODE``, else online with ``$WANDB_API_KEY``, else offline (no account or network needed)."""
    env = os.environ if env is None else env
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    return "online" if env.get("WANDB_API_KEY") else "offline"


def wandb_settings(project: str | None, exp_name: str | None, save_dir: str | None, save: str | None,
                   env: Mapping[str, str] | None = None) -> WandbSettings | None:
    """Validate the flags (None when ``--wandb-project`` is not given); errors are one line."""
    if not project:
        if exp_name or save_dir:
            raise ConfigError("--wandb-exp-name/--wandb-save-dir need --wandb-project")
        return None
    if not exp_name:
        raise ConfigError("--wandb-project needs --wandb-exp-name (the run's name, as in Megatron)")
    if not save_dir and not save:
        raise ConfigError("--wandb-project needs --wandb-save-dir DIR "
                          "(or --save, whose wandb/ subfolder is the default)")
    return WandbSettings(project, exp_name, save_dir or os.path.join(save, "wandb"), wandb_mode(env))


def require_wandb() -> None:
    """Raise a one-line ConfigError when ``wandb`` is not importable."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError(f"--wandb-project needs the wandb package: {INSTALL_HINT}") from None


class WandbWriter:
    """One wandb run; scalars are logged as ``<prefix>/<key>`` at the 1-based iteration."""

    def __init__(self, settings: WandbSettings, config: Mapping | None = None) -> None:
        require_wandb()
        import wandb

        os.makedirs(settings.save_dir, exist_ok=True)
        self.settings = settings
        self.run = wandb.init(
            project=settings.project, name=settings.exp_name, dir=settings.save_dir, mode=settings.mode,
            config=dict(config or {}),
            settings=wandb.Settings(silent=True, console="off", save_code=False, disable_git=True,
                                    x_disable_stats=True, disable_job_creation=True),
        )
        self.run_dir = os.path.dirname(self.run.dir)  # run.dir is <run dir>/files
        log.info(" wandb: %s run %r of project %r in %s%s", settings.mode, settings.exp_name, settings.project,
                 self.run_dir, f" (upload later: wandb sync {self.run_dir})" if settings.mode == "offline" else "")

    def scalars(self, prefix: str, values: Mapping[str, object], step: int) -> None:
        data = {f"{prefix}/{k}": v for k, v in finite_scalars(values).items()}
        if data:
            self.run.log(data, step=step)

    def close(self) -> None:
        """Finish the run and stop wandb's service, which is when an offline run's file is complete."""
        import wandb

        self.run.finish()
        wandb.teardown()


def open_wandb(settings: WandbSettings | None, config: Mapping | None = None) -> WandbWriter | None:
    """A writer when ``--wandb-project`` is given, else None."""
    return WandbWriter(settings, config) if settings is not None else None


__all__ = ["INSTALL_HINT", "WandbSettings", "WandbWriter", "open_wandb", "require_wandb", "wandb_mode",
           "wandb_settings"]
