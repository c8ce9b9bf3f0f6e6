"""The `posttrain` entry point: a Hydra app over conf/train.yaml.

    posttrain                                   # the default job
    posttrain algorithm=sft trainer.max_steps=300
    posttrain experiment=sft_tiny
    posttrain -m seed=0,1,2                      # a sweep (basic launcher, or hydra/launcher=slurm)

`run(cfg)` is the whole job: check the config, build source, tokenizer, policy, module,
datamodule, logger and trainer, fit, then export the model and write summary.json. Its
helpers live beside it: cli.py (command-line rewriting: resume=, sweeps), checkpoints.py
(which checkpoint, and whether it fits), warm_start.py (the cached SFT start of online
runs), tracking.py (W&B / CSV logger), console.py (what is printed).
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from posttrain.cli import resume_arguments, sweep_arguments
from posttrain.errors import ConfigError, PosttrainError, PreemptedError

# The configs ship inside the package (src/posttrain/conf; `conf/` at the top of the source
# tree links to it), so an installed `posttrain` finds them from any working directory.
CONFIG_DIR = str(Path(__file__).resolve().parent / "conf")
# What the user must see goes through this logger: Hydra's logging config sends it to the
# console and to the run's train.log.
log = logging.getLogger("posttrain")


def hydra_choices() -> dict[str, str]:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    return {k: str(v) for k, v in HydraConfig.get().runtime.choices.items() if not k.startswith("hydra")}


def build_callbacks(cfg: DictConfig, output_dir: Path) -> list:
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    from posttrain.callbacks import StepProgressBar, StopAtAccuracy, StopAtStep
    from posttrain.history import MetricsHistory

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
    callbacks.append(MetricsHistory(output_dir))  # <run dir>/metrics.jsonl, whatever the logger (posttrain-report)
    return callbacks


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
    from posttrain.checkpoints import check_checkpoint_algorithm, check_checkpoint_shapes, resolve_ckpt_path
    from posttrain.config_checks import check_config
    from posttrain.data.datamodule import PosttrainDataModule
    from posttrain.data.sources import build_source
    from posttrain.models.loading import load_tokenizer_and_model
    from posttrain.models.memory import check_memory_fits
    from posttrain.sharding import consolidated_model
    from posttrain.tracking import build_logger, finish_logger, run_name, wandb_mode
    from posttrain.models.lora import export_model
    from posttrain.utils import write_json_atomic
    from posttrain.warm_start import warm_start

    for pattern in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)

    OmegaConf.resolve(cfg)  # groups are handed to modules on their own: no dangling interpolations
    choices = hydra_choices()
    check_config(cfg, choices)
    check_memory_fits(cfg)  # sizes from config.json alone: a model too large fails before any weights load
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
    if cfg.get("teacher") is not None:
        from posttrain.models.teacher import resolve_teacher

        # its HF directory into roles.teacher (an embedded recipe is trained once and cached,
        # like the warm start); refused unless it shares the policy's tokenizer
        resolve_teacher(cfg, tokenizer)
    if cfg.algorithm.kind == "preference":  # the pairs, made with (or read for) the starting policy
        from posttrain.data.preference import build_preference_source

        source = build_preference_source(cfg, source, tokenizer, policy)
    elif cfg.algorithm.kind == "process":  # step-labelled responses sampled from the starting policy (algorithm=prm)
        from posttrain.data.process import build_step_source

        source = build_step_source(cfg, source, tokenizer, policy)
    module = build_module(cfg, policy, tokenizer, source)
    module.configure_eval(cfg.eval, samples_dir=output_dir / "samples", seed=cfg.seed)  # samples table, pass@k
    datamodule = PosttrainDataModule(
        source, tokenizer, batch_size=module.batch_size, train_collate=module.train_collate,
        eval_on_pairs=getattr(module, "eval_on_pairs", False), eval_collate=getattr(module, "eval_collate", None),
        eval_split=cfg.eval.split, eval_num_prompts=cfg.eval.num_prompts,
        eval_batch_size=cfg.eval.batch_size, seed=cfg.seed,
    )
    if ckpt_path is not None:
        check_checkpoint_shapes(ckpt_path, stored_shapes, module)
    record = RunRecord(cfg.algorithm.name)  # in every checkpoint: the algorithm, the start metrics
    logger = build_logger(cfg, output_dir, run_name(choices, cfg))
    try:  # run() owns the logger: its run ends with the job, also when the job fails
        from posttrain.preemption import Preemption, cluster_plugins

        # Preemption owns SIGTERM / SIGUSR1 / SIGUSR2 (checkpoint, requeue, non-zero exit);
        # the plugins write checkpoints atomically and keep Lightning's SLURM requeue off
        trainer = instantiate(cfg.trainer, logger=logger,
                              callbacks=build_callbacks(cfg, output_dir) + [record, Preemption(output_dir / "checkpoints")],
                              plugins=cluster_plugins(), enable_progress_bar=cfg.callbacks.progress_bar != "none")
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
        if cfg.algorithm.kind == "preference":
            from posttrain.data.preference import share_summary

            summary.update(share_summary(source))  # pairs/<split>/<kind>_share: what the pairs are made of
        elif cfg.algorithm.kind == "process":
            from posttrain.data.process import step_summary

            summary.update(step_summary(source))  # process/<split>/*, and eval/label_agreement of MC labels
        export = consolidated_model(module.policy)  # every rank gathers a sharded policy; rank 0 gets it whole
        if trainer.is_global_zero:
            export_model(export, tokenizer, output_dir / "hf_model", cfg.model)  # with LoRA: the adapter (or merged)
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
    elif cfg.algorithm.kind == "preference":
        components = dict(roles=cfg.roles)  # roles.reference: what DPO's frozen reference is
    from hydra.errors import InstantiationException

    try:
        return instantiate(algorithm, policy=policy, tokenizer=tokenizer, source=source, rollout=cfg.rollout,
                           eval_max_new_tokens=cfg.eval.max_new_tokens, _recursive_=False, **components)
    except InstantiationException as err:
        # Hydra wraps what the module's __init__ raised; a config mistake must reach the user as itself
        if isinstance(err.__cause__, PosttrainError):
            raise err.__cause__ from None
        raise


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
    except PreemptedError as err:  # stopped by a signal after a checkpoint (Preemption said so): not finished
        sys.exit(err.exit_code)
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
