"""The `posttrain` recipe: a Hydra app over conf/train.yaml, and the one training job.

    posttrain                                   # the default job
    posttrain algorithm=sft trainer.max_steps=300
    posttrain experiment=sft_tiny
    posttrain -m seed=0,1,2                      # a sweep (basic launcher, or hydra/launcher=slurm)

`run(cfg)` reads top to bottom: check the config (config/), prepare what is made once before
training (prepare/: the SFT warm start, a teacher, preference pairs, PRM step rows), build the
tokenizer, policy, module (algorithms/), datamodule (data/), logger and trainer, fit, then export
the model and write summary.json. A run's plumbing (command line, checkpoints, console, tracking,
callbacks, pre-emption, the error boundary) lives in run/. Nothing imports this module: the
warm start and the embedded teachers are trained by `run` itself, handed to prepare/ as `train`.
"""

from __future__ import annotations

import time
from pathlib import Path

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from posttrain.errors import PosttrainError
from posttrain.run.boundary import hydra_choices, hydra_command, log, silence_expected_warnings
from posttrain.run.cli import resume_arguments, sweep_arguments


def run(cfg: DictConfig, announce: bool = True) -> dict:
    """Train as configured; returns the summary dict also written to summary.json.
    `announce`: say what trains where as training starts (the warm start's inner run does not)."""
    # start-up: torch, Lightning and every layer load only once Hydra has composed the command line
    import lightning as L
    import torch

    from posttrain.config.check import check_config
    from posttrain.data.datamodule import PosttrainDataModule
    from posttrain.data.sources import build_source
    from posttrain.distributed.sharding import consolidated_model
    from posttrain.estimate.memory import check_memory_fits
    from posttrain.estimate.stages import checkpointing_mode
    from posttrain.files import write_json_atomic
    from posttrain.models.loading import load_tokenizer_and_model
    from posttrain.models.lora import export_model
    from posttrain.prepare.warm_start import warm_start
    from posttrain.run.callbacks import RunRecord, build_callbacks
    from posttrain.run.checkpoints import (
        check_checkpoint_algorithm,
        check_checkpoint_shapes,
        remove_interrupted_saves,
        resolve_ckpt_path,
    )
    from posttrain.run.console import announce_run, print_before_after
    from posttrain.run.host_memory import return_freed_memory, threshold_kib
    from posttrain.run.precision import cpu_precision
    from posttrain.run.preemption import Preemption, cluster_plugins
    from posttrain.run.tracking import build_logger, finish_logger, run_name, wandb_mode
    from posttrain.run.user_components import check_user_components

    # --- check: the config, the memory it needs, the checkpoint it resumes ---------------------
    silence_expected_warnings()
    OmegaConf.resolve(cfg)  # groups are handed to modules on their own: no dangling interpolations
    choices = hydra_choices()
    check_config(cfg, choices)
    check_user_components(cfg)  # callbacks.extra, logger.extra: importable, the right kind, options they take
    check_memory_fits(cfg)  # sizes from config.json alone: a model too large fails before any weights load
    output_dir = Path(cfg.paths.output_dir)
    remove_interrupted_saves(output_dir / "checkpoints")  # a kill mid-save left them
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, output_dir)
    stored_shapes = check_checkpoint_algorithm(ckpt_path, cfg) if ckpt_path is not None else None
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if cfg.trainer.accelerator == "cpu":  # host memory is the training memory only on CPU
        return_freed_memory(threshold_kib(cfg.host_mmap_threshold_kib, checkpointed=bool(checkpointing_mode(cfg))))
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    # --- prepare: what is made once before training and cached ---------------------------------
    # (the modules of rewards, teachers, pairs and step rows are imported in their branches below,
    # for the cache key: an SFT run, the warm start itself, runs none of them, and
    # prepare/source_key.py follows no import marked "cache key")
    source = build_source(cfg.data)
    if cfg.algorithm.kind == "online":  # a bug in the user's reward function costs seconds, not a warm start
        from posttrain.rewards.build import check_user_functions  # cache key

        check_user_functions(cfg.reward, source, cfg.rollout.max_new_tokens)
    start_dir = warm_start(cfg, train=run)
    if start_dir is not None:
        cfg.model.init_from = start_dir
    # Resuming keeps init_from: the trained weights come from the checkpoint, but frozen roles
    # (the reference) are rebuilt from the policy's starting weights, which checkpoints omit.
    tokenizer, policy = load_tokenizer_and_model(cfg.model, source.alphabet)
    if cfg.get("teacher") is not None:
        # its HF directory into roles.teacher (an embedded recipe is trained once and cached,
        # like the warm start); refused unless it shares the policy's tokenizer
        from posttrain.prepare.teachers import resolve_teacher  # cache key

        resolve_teacher(cfg, tokenizer, train=run)
    if cfg.algorithm.kind == "preference":  # the pairs, made with (or read for) the starting policy
        from posttrain.prepare.preference_pairs import build_preference_source  # cache key

        source = build_preference_source(cfg, source, tokenizer, policy)
    elif cfg.algorithm.kind == "process":  # step-labelled responses sampled from the starting policy (algorithm=prm)
        from posttrain.prepare.step_rows import build_step_source  # cache key

        source = build_step_source(cfg, source, tokenizer, policy)

    # --- build: module, datamodule, logger, trainer ---------------------------------------------
    module = build_module(cfg, policy, tokenizer, source)
    module.configure_eval(cfg.eval, samples_dir=output_dir / "samples", seed=cfg.seed,
                          panel_dir=output_dir / "panel")  # samples table, pass@k, prompt panel
    datamodule = PosttrainDataModule(
        source, tokenizer, batch_size=module.batch_size, train_collate=module.train_collate,
        eval_on_pairs=getattr(module, "eval_on_pairs", False), eval_collate=getattr(module, "eval_collate", None),
        sft_row_length=getattr(module, "sft_row_length", None),
        eval_split=cfg.eval.split, eval_num_prompts=cfg.eval.num_prompts,
        eval_batch_size=cfg.eval.batch_size, seed=cfg.seed,
    )
    if ckpt_path is not None:
        check_checkpoint_shapes(ckpt_path, stored_shapes, module)
    record = RunRecord(cfg.algorithm.name)  # in every checkpoint: the algorithm, the start metrics
    # bf16-mixed on a CPU without native bf16 would emulate it, for nothing: 32-true, said below
    cfg.trainer.precision, precision_change = cpu_precision(cfg.trainer.precision, cfg.trainer.accelerator)
    logger = build_logger(cfg, output_dir, run_name(choices, cfg))
    try:  # run() owns the logger: its run ends with the job, also when the job fails
        # Preemption owns SIGTERM / SIGUSR1 / SIGUSR2 (checkpoint, requeue, non-zero exit);
        # the plugins write checkpoints atomically and keep Lightning's SLURM requeue off
        trainer = instantiate(cfg.trainer, logger=logger,
                              callbacks=build_callbacks(cfg, output_dir) + [record, Preemption(output_dir / "checkpoints")],
                              plugins=cluster_plugins(), enable_progress_bar=cfg.callbacks.progress_bar != "none")
        if precision_change is not None and trainer.is_global_zero:
            print(precision_change, flush=True)
        if announce and trainer.is_global_zero:
            announce_run(cfg, choices, output_dir, ckpt_path)

        # --- fit ----------------------------------------------------------------------------------
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
            from posttrain.data.preference import share_summary  # cache key

            summary.update(share_summary(source))  # pairs/<split>/<kind>_share: what the pairs are made of
        elif cfg.algorithm.kind == "process":
            from posttrain.data.process import step_summary  # cache key

            summary.update(step_summary(source))  # process/<split>/*, and eval/label_agreement of MC labels

        # --- export: the model, summary.json ---------------------------------------------------------
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
    OmegaConf.resolve(cfg)  # the groups are handed over on their own: no dangling interpolations
    algorithm = {k: v for k, v in cfg.algorithm.items() if k not in ("name", "kind", "warm_start")}
    components = {}
    if cfg.algorithm.kind == "online":
        components = dict(kl_estimator=cfg.kl_estimator, advantage=cfg.advantage, reward=cfg.reward,
                          data_curriculum=cfg.data_curriculum, roles=cfg.roles, cache_dir=cfg.paths.cache_dir,
                          seed=cfg.seed, env=cfg.env)
    elif cfg.algorithm.kind == "offline":
        components = dict(env=cfg.env)  # SFT on an environment's worked episodes (envs/worked.py)
    elif cfg.algorithm.kind == "preference":
        components = dict(roles=cfg.roles)  # roles.reference: what DPO's frozen reference is
    try:
        return instantiate(algorithm, policy=policy, tokenizer=tokenizer, source=source, rollout=cfg.rollout,
                           eval_max_new_tokens=cfg.eval.max_new_tokens, _recursive_=False, **components)
    except InstantiationException as err:
        # Hydra wraps what the module's __init__ raised; a config mistake must reach the user as itself
        if isinstance(err.__cause__, PosttrainError):
            raise err.__cause__ from None
        raise


main = hydra_command("posttrain", "train", run, log_name="train.log",
                     rewrite_arguments=lambda arguments: sweep_arguments(resume_arguments(arguments)))

if __name__ == "__main__":
    main()
