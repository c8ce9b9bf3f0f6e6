"""Experiment tracking: the job's logger (W&B, CSV or none), its run's name, id and mode."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from posttrain.errors import ConfigError


def build_logger(cfg: DictConfig, output_dir: Path, run_name: str):
    backend = cfg.logger.backend
    if backend == "none":
        return False
    if backend == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=str(output_dir), name="csv", version="")
    if backend == "wandb":
        import wandb
        from lightning.pytorch.loggers import WandbLogger

        from posttrain.console import wandb_settings

        mode = wandb_mode(cfg)
        logger = WandbLogger(
            project=cfg.logger.project, entity=cfg.logger.entity, name=run_name, group=cfg.task_name,
            tags=list(cfg.logger.tags), save_dir=str(output_dir), mode=mode,
            id=wandb_run_id(output_dir), resume="allow",  # a resumed run continues its W&B run
            config=OmegaConf.to_container(cfg, resolve=True), settings=wandb.Settings(**wandb_settings(mode)),
        )
        # Lightning always passes `anonymous` to wandb.init, and W&B warns on every run that
        # the setting does nothing: leave it unset
        logger._wandb_init.pop("anonymous", None)
        return logger
    raise ConfigError(f"logger.backend={backend!r} is not one of ['wandb', 'csv', 'none']")


def finish_logger(logger, failed: bool) -> None:
    """End this job's tracking run. W&B keeps one run per process until it is finished, and
    a later WandbLogger silently reuses it: without this every job after the first of a
    local multirun (basic launcher, all jobs in one process) would log into the first's run."""
    from lightning.pytorch.loggers import WandbLogger

    if isinstance(logger, WandbLogger) and logger._experiment is not None:  # None: never started
        logger._experiment.finish(exit_code=1 if failed else 0)  # a failed job's run is marked failed


def wandb_run_id(output_dir: Path) -> str:
    """The id of the W&B run of this run directory, made at its first start and kept in
    <run dir>/wandb_run_id.txt, so `posttrain resume=<run dir>` logs into the same W&B run."""
    import uuid

    record = output_dir / "wandb_run_id.txt"
    if record.is_file():
        return record.read_text().strip()
    run_id = uuid.uuid4().hex[:12]  # W&B ids: letters and digits, unique within the project
    output_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(run_id + "\n")
    return run_id


def wandb_mode(cfg: DictConfig) -> str:
    """`logger.mode=auto`: WANDB_MODE if set, online with credentials, else offline."""
    if cfg.logger.mode != "auto":
        return cfg.logger.mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = Path.home() / ".netrc"
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (
        netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"))
    return "online" if has_key else "offline"


def run_name(choices: dict[str, str], cfg: DictConfig) -> str:
    picked = [choices.get(g) for g in ("algorithm", "advantage", "kl_estimator") if choices.get(g) not in (None, "none")]
    if choices.get("numerics") not in (None, "posttrain"):
        picked.append(f"{choices['numerics']}-numerics")
    return "-".join(picked + [f"seed{cfg.seed}"]) if picked else f"{cfg.task_name}-seed{cfg.seed}"
