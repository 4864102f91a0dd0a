"""Weights & Biases logging (`metrics.enable_wandb`): rank 0 logs the step line's scalars and the resolved
config; a resumed job continues the same W&B run.

The run id is kept in <dump_folder>/wandb_run_id, so a job that resumes from its dump folder logs into the
run it started; a job that starts over (no checkpoint to resume) starts a new run. W&B's own files go
under <dump_folder>/wandb. Every WANDB_* environment variable works as usual (WANDB_MODE=offline needs no
network and no account; `wandb sync` uploads later); a [metrics] setting that is set wins over its variable.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from pathlib import Path

from titanlite.errors import ConfigError

RUN_ID_FILE = "wandb_run_id"


def wandb_problem(metrics_cfg) -> str | None:
    """Why metrics.enable_wandb cannot work here (the package is missing or fails to import), or None."""
    if not metrics_cfg.enable_wandb:
        return None
    if importlib.util.find_spec("wandb") is None:
        return (
            "metrics.enable_wandb = true needs the wandb package, which is not installed: "
            "pip install 'titanlite[wandb]' (or pip install wandb), or set metrics.enable_wandb = false"
        )
    try:
        importlib.import_module("wandb")  # slow, but only for a run that asks for it, and only once
    except Exception as e:  # a broken install: ImportError, or whatever its own imports raise
        return (
            f"metrics.enable_wandb = true, but the installed wandb package fails to import ({type(e).__name__}: "
            f"{str(e)[:300]}); reinstall it (pip install --force-reinstall wandb) or set metrics.enable_wandb = false"
        )
    return None


class WandbRun:
    """One W&B run of a training job (create on rank 0 only)."""

    def __init__(self, metrics_cfg, dump_folder: str, config: dict, resumed: bool):
        import wandb  # lazy: optional, and slow to import

        self.wandb = wandb
        folder = Path(dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / RUN_ID_FILE
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None
        if run_id is None:
            run_id = os.environ.get("WANDB_RUN_ID") or uuid.uuid4().hex[:12]
            id_file.write_text(run_id + "\n")
        try:
            self.run = wandb.init(
                project=metrics_cfg.wandb_project or os.environ.get("WANDB_PROJECT") or "titanlite",
                entity=metrics_cfg.wandb_entity or None,
                name=metrics_cfg.wandb_run_name or None,
                dir=str(folder),
                id=run_id,
                resume="allow",
                config=config,
            )
        except Exception as e:  # no API key, no network, a bad entity: W&B raises many kinds
            raise ConfigError(
                f"metrics.enable_wandb = true but W&B could not start a run ({type(e).__name__}: {str(e)[:300]}); "
                "log in with `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to log to files "
                "and `wandb sync` them later"
            ) from None
        self.resumed = resumed

    def log(self, scalars: dict[str, float], step: int) -> None:
        """Scalars of one step, by tag (the TensorBoard tags)."""
        self.run.log(scalars, step=step)

    def close(self) -> None:
        """Finish the run (flushes; in offline mode writes the run folder)."""
        self.run.finish()
