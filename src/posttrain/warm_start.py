"""The SFT warm start of an online run: planned from the run's config, trained once (by the
entry point's own `run`), cached under a key of what it depends on, shared by every run."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from posttrain.errors import ConfigError

log = logging.getLogger("posttrain")


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
    from posttrain.train import run  # the entry point's own job, run for the SFT config

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
    from posttrain.train import CONFIG_DIR

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
