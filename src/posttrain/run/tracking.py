"""Experiment tracking: the job's logger (W&B, CSV or none, and the user's own beside it), its
run's name, group, tags, id and mode.

One W&B run per job: named from the Hydra choices (`run_name`), tagged `group:option` with
them, `job_type` the algorithm, grouped by sweep (`wandb_group`), its config the resolved
config plus the code's git commit. The run id is kept in the run dir, so a resumed or
requeued job logs into the same run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from posttrain.errors import ConfigError
from posttrain.run.boundary import hydra_choices
from posttrain.run.console import wandb_settings
from posttrain.run.user_components import build_user_components

# Choices that say where and how a job runs, not what it trains: not made into tags.
UNTAGGED_GROUPS = ("paths", "logger", "callbacks")


def build_logger(cfg: DictConfig, output_dir: Path, run_name: str):
    """What the Trainer's `logger` gets: the backend's logger and the user's own (`logger.extra`),
    a list when there are several; False for none at all."""
    backend = backend_logger(cfg, output_dir, run_name)
    loggers = ([backend] if backend is not None else []) + build_user_components(cfg, "logger.extra")
    if not loggers:
        return False
    return loggers[0] if len(loggers) == 1 else loggers


def backend_logger(cfg: DictConfig, output_dir: Path, run_name: str):
    """The logger of `logger.backend`; None for `none`."""
    backend = cfg.logger.backend
    if backend == "none":
        return None
    if backend == "csv":
        # start-up: the command line is parsed before this loads
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=str(output_dir), name="csv", version="")
    if backend == "wandb":
        # start-up: W&B loads only for logger=wandb
        import wandb
        from lightning.pytorch.loggers import WandbLogger

        mode = wandb_mode(cfg)
        logger = WandbLogger(
            project=cfg.logger.project, entity=cfg.logger.entity, name=run_name, group=wandb_group(cfg, output_dir),
            job_type=cfg.logger.get("job_type") or cfg.algorithm.name,
            tags=choice_tags(hydra_choices()) + list(cfg.logger.tags), save_dir=str(output_dir), mode=mode,
            id=wandb_run_id(output_dir), resume="allow",  # a resumed run continues its W&B run
            config=run_config(cfg), settings=wandb.Settings(**wandb_settings(mode)),
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
    # start-up: the command line is parsed before this loads
    from lightning.pytorch.loggers import WandbLogger

    for one in logger if isinstance(logger, list) else [logger]:
        if isinstance(one, WandbLogger) and one._experiment is not None:  # None: never started
            one._experiment.finish(exit_code=1 if failed else 0)  # a failed job's run is marked failed


def wandb_run_id(output_dir: Path) -> str:
    """The id of the W&B run of this run directory, made at its first start and kept in
    <run dir>/wandb_run_id.txt, so `posttrain resume=<run dir>` logs into the same W&B run."""
    # start-up: the command line is parsed before this loads
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


def choice_tags(choices: dict[str, str]) -> list[str]:
    """`group:option` for each Hydra choice of what is trained (all of them, defaults too, so
    that a filter on `rollout:fast` also finds the runs that did not say it)."""
    return [f"{group}:{option}" for group, option in sorted(choices.items())
            if group not in UNTAGGED_GROUPS and option not in (None, "None", "null")]


def sweep_dir_of(output_dir: Path) -> Path | None:
    """The sweep directory of a multirun job, None for a single run. A resumed sweep job
    (`posttrain resume=<run dir>`) runs as a single run into its old run dir: it is known by
    the multirun.yaml Hydra wrote in the run dir's parent, so it keeps its sweep's group."""
    # start-up: the command line is parsed before this loads
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return Path(HydraConfig.get().sweep.dir)
    if (output_dir.parent / "multirun.yaml").is_file():
        return output_dir.parent
    return None


def wandb_group(cfg: DictConfig, output_dir: Path) -> str:
    """A single run: `logger.group`, else the task name. A sweep job: `<name>-<sweep time>`,
    one group for the whole sweep, where the name is `logger.group`, else the task name when
    every job shares it, else `sweep` (a sweep over algorithm=, experiment= or task_name=)."""
    sweep_dir = sweep_dir_of(output_dir)
    name = cfg.logger.get("group")
    if sweep_dir is None:
        return str(name or cfg.task_name)
    if not name:
        name = "sweep" if sweeps_task(sweep_dir) else cfg.task_name
    return f"{name}-{sweep_dir.name}"  # the sweep dir is named by its start time


def sweeps_task(sweep_dir: Path) -> bool:
    """Whether the sweep's jobs may have different task names: its command line (multirun.yaml,
    written by Hydra before the first job) sweeps a key the task name comes from. Unknown
    (no multirun.yaml): assumed so, which keeps one group for the sweep."""
    # start-up: the command line is parsed before this loads
    from hydra.core.override_parser.overrides_parser import OverridesParser

    record = sweep_dir / "multirun.yaml"
    if not record.is_file():
        return True
    overrides = list(OmegaConf.load(record).hydra.overrides.task)
    swept = {o.key_or_group for o in OverridesParser.create().parse_overrides(overrides) if o.is_sweep_override()}
    return bool(swept & {"algorithm", "experiment", "preset", "task_name"})


def run_config(cfg: DictConfig) -> dict:
    """What the W&B run stores as its config: the resolved config, and the code's git commit."""
    config = OmegaConf.to_container(cfg, resolve=True)
    config["git_commit"], config["git_dirty"] = git_state(Path(__file__).resolve().parent)
    return config


def git_state(source_dir: Path) -> tuple[str | None, bool | None]:
    """(commit, uncommitted changes to tracked files) of the checkout holding the code; (None,
    None) for an installed package or without git. Bounded by a timeout: a hung git on a
    network file system must not hold up the job."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(source_dir), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):  # no git, not a checkout, or too slow
        return None, None
    return commit, dirty
