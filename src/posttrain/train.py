"""The `posttrain` entry point: a Hydra app over conf/train.yaml.

    posttrain                                   # the default job
    posttrain algorithm=sft trainer.max_steps=300
    posttrain experiment=sft_tiny
    posttrain -m seed=0,1,2                      # a sweep (basic launcher, or hydra/launcher=slurm)

`run(cfg)` is the whole job: check the config, build source, tokenizer, policy, module,
datamodule, logger and trainer, fit, then export the model and write summary.json.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import hashlib
import logging

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from posttrain.errors import CheckpointError, ConfigError, PosttrainError

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "conf")
# What the user must see goes through this logger: Hydra's logging config sends it to the
# console and to the run's train.log.
log = logging.getLogger("posttrain")


def hydra_choices() -> dict[str, str]:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    return {k: str(v) for k, v in HydraConfig.get().runtime.choices.items() if not k.startswith("hydra")}


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


def build_callbacks(cfg: DictConfig, output_dir: Path) -> list:
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    from posttrain.callbacks import StepProgressBar, StopAtAccuracy, StopAtStep

    callbacks = [
        ModelCheckpoint(
            dirpath=str(output_dir / "checkpoints"), filename="step{step:06d}", auto_insert_metric_name=False,
            every_n_train_steps=cfg.callbacks.checkpoint.every_n_train_steps,
            save_top_k=cfg.callbacks.checkpoint.save_top_k, save_last=True,
        ),
    ]
    if cfg.callbacks.get("stop_at_step"):
        callbacks.append(StopAtStep(cfg.callbacks.stop_at_step))
    if cfg.callbacks.get("stop_at_accuracy") is not None:
        callbacks.append(StopAtAccuracy(cfg.callbacks.stop_at_accuracy))
    if cfg.callbacks.progress_bar not in ("rich", "none"):
        raise ConfigError(f"callbacks.progress_bar={cfg.callbacks.progress_bar!r} is not one of ['rich', 'none']")
    if cfg.callbacks.progress_bar == "rich":
        callbacks.append(StepProgressBar())
    if cfg.logger.backend != "none":
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    return callbacks


def resolve_ckpt_path(ckpt_path: str | None, output_dir: Path) -> str | None:
    if ckpt_path is None:
        return None
    path = output_dir / "checkpoints" / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"ckpt_path={ckpt_path!r}: no checkpoint file at {path}")
    return str(path)


def run_name(choices: dict[str, str], cfg: DictConfig) -> str:
    picked = [choices.get(g) for g in ("algorithm", "advantage", "kl_estimator") if choices.get(g) not in (None, "none")]
    if choices.get("numerics") not in (None, "posttrain"):
        picked.append(f"{choices['numerics']}-numerics")
    return "-".join(picked + [f"seed{cfg.seed}"]) if picked else f"{cfg.task_name}-seed{cfg.seed}"


# Lightning warnings that our setup triggers by design, silenced so real ones stand out:
# the frozen reference model is in eval mode; RL modules optimise manually and checkpoint
# after the step on purpose; a deprecation inside Lightning's own pytree helper.
EXPECTED_WARNINGS = (
    r"Found \d+ module\(s\) in eval mode",
    r"Using ModelCheckpoint with manual optimization",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
)


def run(cfg: DictConfig, announce: bool = True) -> dict:
    """Train as configured; returns the summary dict also written to summary.json.
    `announce`: say what trains where as training starts (the warm start's inner run does not)."""
    import warnings

    import lightning as L
    import torch
    from hydra.utils import instantiate

    from posttrain.callbacks import RunRecord
    from posttrain.config_checks import check_config
    from posttrain.data.datamodule import PosttrainDataModule
    from posttrain.data.sources import build_source
    from posttrain.models.loading import load_tokenizer_and_model
    from posttrain.utils import save_pretrained_atomic, write_json_atomic

    for pattern in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)

    OmegaConf.resolve(cfg)  # groups are handed to modules on their own: no dangling interpolations
    choices = hydra_choices()
    check_config(cfg, choices)
    output_dir = Path(cfg.paths.output_dir)
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, output_dir)
    stored_shapes = check_checkpoint_algorithm(ckpt_path, cfg) if ckpt_path is not None else None
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    source = build_source(cfg.data)
    start_dir = warm_start(cfg)
    if start_dir is not None:
        cfg.model.init_from = start_dir
    # Resuming keeps init_from: the trained weights come from the checkpoint, but frozen roles
    # (the reference) are rebuilt from the policy's starting weights, which checkpoints omit.
    tokenizer, policy = load_tokenizer_and_model(cfg.model, source.alphabet)
    module = build_module(cfg, policy, tokenizer, source)
    datamodule = PosttrainDataModule(
        source, tokenizer, batch_size=module.batch_size, train_collate=module.train_collate,
        eval_split=cfg.eval.split, eval_num_prompts=cfg.eval.num_prompts,
        eval_batch_size=cfg.eval.batch_size, seed=cfg.seed,
    )
    if ckpt_path is not None:
        check_checkpoint_shapes(ckpt_path, stored_shapes, module)
    record = RunRecord(cfg.algorithm.name)  # in every checkpoint: the algorithm, the start metrics
    logger = build_logger(cfg, output_dir, run_name(choices, cfg))
    try:  # run() owns the logger: its run ends with the job, also when the job fails
        trainer = instantiate(cfg.trainer, logger=logger, callbacks=build_callbacks(cfg, output_dir) + [record],
                              enable_progress_bar=cfg.callbacks.progress_bar != "none")
        if announce and trainer.is_global_zero:
            announce_run(cfg, choices, output_dir, ckpt_path)

        if cfg.eval.at_start and ckpt_path is None:
            start_metrics = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
            record.start_metrics = {k: float(v) for k, v in start_metrics.items()}
        started = time.perf_counter()
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        train_seconds = time.perf_counter() - started
        summary = {f"{k}_start": v for k, v in record.start_metrics.items()}  # restored on resume
        summary.update({k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1})
        if module.evaluated_at_step != trainer.global_step:  # the summary always holds the final model's eval
            summary.update({k: float(v) for k, v in trainer.validate(module, datamodule=datamodule, verbose=False)[0].items()})
        summary.update(global_step=trainer.global_step, train_seconds=round(train_seconds, 2),
                       choices=choices, run_dir=str(output_dir), warm_start=start_dir)
        if trainer.is_global_zero:
            save_pretrained_atomic(module.policy, tokenizer, output_dir / "hf_model")
            write_json_atomic(output_dir / "summary.json", summary)
            print_before_after(summary)
            if cfg.logger.backend == "wandb" and wandb_mode(cfg) == "offline":
                log.info(f"W&B ran offline (no credentials); upload with: wandb sync {output_dir / 'wandb'}/offline-run-*")
    except BaseException:
        finish_logger(logger, failed=True)
        raise
    finish_logger(logger, failed=False)
    return summary


def build_module(cfg: DictConfig, policy, tokenizer, source):
    """Instantiate `algorithm._target_` with the pieces every module gets, plus the
    component groups (KL, advantage, reward, curriculum) for online algorithms."""
    from hydra.utils import instantiate

    OmegaConf.resolve(cfg)  # the groups are handed over on their own: no dangling interpolations
    algorithm = {k: v for k, v in cfg.algorithm.items() if k not in ("name", "kind", "warm_start")}
    components = {}
    if cfg.algorithm.kind == "online":
        components = dict(kl_estimator=cfg.kl_estimator, advantage=cfg.advantage, reward=cfg.reward,
                          data_curriculum=cfg.data_curriculum, roles=cfg.roles, cache_dir=cfg.paths.cache_dir,
                          seed=cfg.seed)
    from hydra.errors import InstantiationException

    try:
        return instantiate(algorithm, policy=policy, tokenizer=tokenizer, source=source, rollout=cfg.rollout,
                           eval_max_new_tokens=cfg.eval.max_new_tokens, _recursive_=False, **components)
    except InstantiationException as err:
        # Hydra wraps what the module's __init__ raised; a config mistake must reach the user as itself
        if isinstance(err.__cause__, PosttrainError):
            raise err.__cause__ from None
        raise


def warm_start(cfg: DictConfig) -> str | None:
    """The SFT start of an online run: trained once, then cached under paths.cache_dir keyed
    by everything it depends on, so every run of a sweep starts from the same weights
    (`warm_start.seed` is its own seed, fixed by default: `seed=0,1,2` vary the RL only).
    With `until_accuracy` it evaluates every `eval_every` steps and stops at the first
    held-out greedy accuracy at or above the target (`steps` is then the cap): the pace of
    the SFT learning curve varies by seed, so a step count alone lands at different points.
    Returns its Hugging Face directory, or None when the run starts otherwise."""
    plan = warm_start_plan(cfg)
    if plan is None:
        return None
    sft_cfg, target = plan
    if (target / "hf_model").is_dir():
        return str(target / "hf_model")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # every process would train its own copy and race for the cache: build it once first
        raise ConfigError(f"the SFT warm start of this config is not cached yet ({target}); build it once in a "
                          f"single process (the same command without torchrun, with trainer=cpu "
                          f"trainer.max_steps=1), or start from weights with model.init_from=<dir>")
    settings = cfg.algorithm.warm_start
    target_accuracy = settings.get("until_accuracy")
    goal = " for" if target_accuracy is None else f" until held-out accuracy >= {target_accuracy:.0%}, for at most"
    log.info(f"Warm start: SFT{goal} {settings.steps} steps, cached at {target}")
    scratch = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open_dict(sft_cfg):
        sft_cfg.paths.output_dir = str(scratch)
    summary = run(sft_cfg, announce=False)
    log.info(f"Warm start: stopped at step {summary['global_step']}, "
             f"held-out accuracy {summary.get('eval/accuracy', float('nan')):.1%}")
    if not target.exists():  # a concurrent job of the same sweep may have finished first
        os.replace(scratch, target)
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    return str(target / "hf_model")


def warm_start_plan(cfg: DictConfig) -> tuple[DictConfig, Path] | None:
    """The warm start's SFT config and its cache directory, or None when the run has none.
    The cache key holds only what the SFT run reads (never run paths, never the RL settings),
    so every online preset and every seed of a sweep share one warm start."""
    settings = cfg.algorithm.get("warm_start")
    if cfg.algorithm.kind != "online" or not settings or settings.steps <= 0:
        return None
    if cfg.model.init_from:
        return None  # (a resumed run finds its warm start in the cache: its frozen roles start there)
    target_accuracy = settings.get("until_accuracy")
    if target_accuracy is not None and not 0.0 < target_accuracy <= 1.0:
        raise ConfigError(f"algorithm.warm_start.until_accuracy={target_accuracy} must lie in (0, 1]")
    sft = OmegaConf.load(Path(CONFIG_DIR) / "algorithm" / "sft.yaml")
    sft.optim.lr, sft.batch_size = settings.lr, settings.batch_size
    sft_cfg = cfg.copy()
    with open_dict(sft_cfg):
        sft_cfg.algorithm = sft
        # the warm start's own seed (data order, init) so a seed sweep shares one start
        sft_cfg.seed = cfg.seed if settings.get("seed") is None else settings.seed
        if "seed" in sft_cfg.data:
            sft_cfg.data.seed = sft_cfg.seed
        for group in ("advantage", "kl_estimator", "data_curriculum"):
            sft_cfg[group] = {"name": "none"}
        # one process trains it, whatever the RL run's parallelism: trainer=ddp shares trainer=cpu's
        sft_cfg.trainer.devices = 1
        sft_cfg.trainer.pop("strategy", None)
        sft_cfg.trainer.max_steps = settings.steps
        sft_cfg.trainer.val_check_interval = settings.steps if target_accuracy is None else settings.eval_every
        sft_cfg.callbacks.checkpoint.every_n_train_steps = settings.steps
        sft_cfg.callbacks.stop_at_step = None
        sft_cfg.callbacks.stop_at_accuracy = target_accuracy
        if not sys.stdout.isatty():  # a log file gets its two lines, not a line per eval
            sft_cfg.callbacks.progress_bar = "none"
        sft_cfg.eval.at_start = False
        sft_cfg.logger = {"backend": "none"}
    identity_cfg = OmegaConf.masked_copy(sft_cfg, ["algorithm", "model", "data", "seed", "trainer", "eval"])
    identity_cfg.stop_at_accuracy = target_accuracy
    identity_cfg.trainer.pop("default_root_dir", None)  # the run dir must not change the key
    identity = OmegaConf.to_yaml(identity_cfg)
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return sft_cfg, Path(cfg.paths.cache_dir) / "warm_start" / key


def resume_arguments(arguments: list[str]) -> list[str]:
    """`posttrain resume=<run dir> [overrides]` -> that run's own command line: its saved
    overrides (.hydra/overrides.yaml) replayed, later overrides winning, into the same run
    directory, from its last checkpoint. Other command lines are returned as they are."""
    import yaml

    requested = [a for a in arguments if a.startswith("resume=")]
    if not requested:
        return arguments
    if len(requested) > 1 or any(a in ("-m", "--multirun") for a in arguments):
        raise ConfigError("resume=<run dir> resumes one run: give it once, without -m")
    run_dir = Path(requested[0].split("=", 1)[1]).expanduser().resolve()
    saved_overrides = run_dir / ".hydra" / "overrides.yaml"
    if not saved_overrides.is_file():
        raise CheckpointError(f"{requested[0]}: {run_dir} is not a posttrain run directory "
                              f"(it has no .hydra/overrides.yaml)")
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    if not checkpoint.is_file():
        raise CheckpointError(f"{requested[0]}: the run has no checkpoint to resume from ({checkpoint} is missing: "
                              f"it stopped before its first one); start it again instead")
    extra = [a for a in arguments if not a.startswith("resume=")]
    # stop_at_step simulates a preemption: replaying it would stop the resumed run again
    replaced = {override_key(a) for a in extra} | {"ckpt_path", "hydra.run.dir", "callbacks.stop_at_step"}
    replayed = [o for o in yaml.safe_load(saved_overrides.read_text()) or [] if override_key(o) not in replaced]
    return replayed + extra + [f"hydra.run.dir={run_dir}", f"ckpt_path={checkpoint}"]


# A swept group and the config keys its options set: an experiment preset sets algorithm keys.
SWEPT_GROUP_KEYS = {"experiment": ("algorithm",)}


def sweep_arguments(arguments: list[str]) -> list[str]:
    """Let a sweep over a config group set keys that only the swept options have.

    Hydra composes a sweep's own config from the primary defaults and the overrides that are
    not swept, so `-m algorithm=grpo,dapo algorithm.group_size=4` fails against the default
    algorithm (sft has no group_size) before any job starts. Overrides of keys under a swept
    group become `++` overrides (set, or add where missing: Hydra's own remedy); every job
    still composes its own config, and validation names a key its algorithm does not take."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if not any(a in ("-m", "--multirun") for a in arguments):
        return arguments
    overrides = [a for a in arguments if not a.startswith("-") and "=" in a]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return arguments  # Hydra reports the malformed override itself
    swept = {o.key_or_group for o in parsed if o.is_sweep_override() and "." not in o.key_or_group}
    prefixes = tuple(f"{key}." for group in swept for key in (group, *SWEPT_GROUP_KEYS.get(group, ())))
    forced = {o.input_line: f"++{o.input_line}" for o in parsed
              if o.type.name == "CHANGE" and not o.is_sweep_override() and o.key_or_group.startswith(prefixes)}
    return [forced.get(a, a) for a in arguments]


def override_key(override: str) -> str:
    """The key an override sets: `+trainer.max_time=1` -> `trainer.max_time`."""
    return override.split("=", 1)[0].lstrip("+~")


def check_checkpoint_algorithm(ckpt_path: str, cfg: DictConfig) -> dict:
    """Refuse, before anything is built, a checkpoint written by another algorithm; returns
    the shapes of its weights for `check_checkpoint_shapes`. (Memory-mapped: cheap to read.)"""
    import torch

    checkpoint = torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=False)
    written_by = checkpoint.get("callbacks", {}).get("RunRecord", {}).get("algorithm")
    if written_by is not None and written_by != cfg.algorithm.name:
        raise CheckpointError(f"ckpt_path={ckpt_path} was written by algorithm={written_by}, but this run is "
                              f"algorithm={cfg.algorithm.name}; resume it as it was started with "
                              f"`posttrain resume=<its run dir>`, or start from its weights with "
                              f"model.init_from={ckpt_path}")
    return {k: v.shape for k, v in checkpoint["state_dict"].items()}


def check_checkpoint_shapes(ckpt_path: str, stored: dict, module) -> None:
    """Refuse weights of another shape than this run's model (the run was started with other
    overrides: `posttrain resume=<run dir>` replays them) before Lightning fails on them."""
    frozen = tuple(f"{role}." for role in getattr(module, "frozen_roles", list)())
    expected = {k: v.shape for k, v in module.state_dict().items() if not k.startswith(frozen)}
    for key in sorted(expected.keys() | stored.keys()):
        if expected.get(key) != stored.get(key):
            describe = lambda shape: "absent" if shape is None else f"of shape {tuple(shape)}"  # noqa: E731
            raise CheckpointError(f"ckpt_path={ckpt_path} does not fit this run's model: {key} is "
                                  f"{describe(stored.get(key))} there and {describe(expected.get(key))} here. "
                                  f"Resume a run with the overrides it was started with: "
                                  f"`posttrain resume=<its run dir>`")


ANNOUNCED_GROUPS = ("experiment", "algorithm", "advantage", "kl_estimator", "reward", "data_curriculum", "model",
                    "data")


def announce_run(cfg: DictConfig, choices: dict[str, str], output_dir: Path, ckpt_path: str | None) -> None:
    """One line on what trains and where, as training starts; the resolved config is saved
    beside it (and printed as a tree with print_config=true)."""
    from posttrain.utils import print_config_tree, save_config_atomic

    save_config_atomic(cfg, output_dir / "config.yaml")
    picked = " ".join(f"{group}={choices[group]}" for group in ANNOUNCED_GROUPS if choices.get(group) not in (None, "None"))
    action = f"resuming from {ckpt_path}" if ckpt_path else f"training for {cfg.trainer.max_steps} steps"
    log.info(f"{picked} seed={cfg.seed}\n{action}; run dir {output_dir}")
    if cfg.print_config:
        print_config_tree(cfg)


def print_before_after(summary: dict) -> None:
    if "eval/accuracy_start" not in summary or "eval/accuracy" not in summary:
        return
    from rich.table import Table

    from posttrain.console import render

    table = Table(title="held-out evaluation (greedy)")
    for column in ("", "start", "end", "change"):
        table.add_column(column, justify="right")
    for name, scale, unit in (("accuracy", 100, " pts"), ("response_len", 1, " tok")):
        before, after = summary[f"eval/{name}_start"], summary[f"eval/{name}"]
        table.add_row(name, f"{before * scale:.1f}", f"{after * scale:.1f}", f"{(after - before) * scale:+.1f}{unit}")
    log.info(render(table))  # through the logger: the table is also in train.log


def remove_unused_run_dir(output_dir: Path, log_dir: Path, log_name: str = "train.log") -> None:
    """A run that failed before writing anything of its own leaves no directory behind (nor
    the empty parents Hydra made for it, up to paths.log_dir)."""
    if not output_dir.is_dir() or any(p.name not in (".hydra", log_name) for p in output_dir.iterdir()):
        return
    shutil.rmtree(output_dir, ignore_errors=True)
    log_dir = log_dir.resolve()
    for parent in output_dir.resolve().parents:
        if parent == log_dir or log_dir not in parent.parents or any(parent.iterdir()):
            break
        parent.rmdir()


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def _hydra_entry(cfg: DictConfig) -> None:
    from omegaconf.errors import OmegaConfBaseException

    from posttrain.console import setup_console

    setup_console()  # Lightning's own console handler (every line twice), HF progress bars, warnings to train.log
    try:
        run(cfg)
    except (PosttrainError, OmegaConfBaseException) as err:
        log.error(f"posttrain: error: {err}")
        remove_unused_run_dir(Path(cfg.paths.output_dir), Path(cfg.paths.log_dir))
        sys.exit(1)
    except Exception:  # a bug: its traceback printed once, and kept in train.log
        log.exception("posttrain: unexpected error (a bug: please report it with this traceback)")
        sys.exit(1)


def main() -> None:
    try:
        sys.argv[1:] = sweep_arguments(resume_arguments(sys.argv[1:]))
    except PosttrainError as err:
        print(f"posttrain: error: {err}", file=sys.stderr)
        sys.exit(1)
    _hydra_entry()


if __name__ == "__main__":
    main()
