"""The SFT warm start of an online run: planned from the run's config, trained once by the
recipe's own `run` (handed in as `train`: nothing imports train.py), cached (prepare/cache.py)
under a key of what it depends on, shared by every run. The embedded teachers of distillation
(prepare/teachers.py) are SFT runs cached the same way: `sft_plan` and `cached_sft_model` serve
both. Only rank 0 of a multi-process job trains it, alone, before the job's process group exists
(its trainer has one device and no strategy, so it joins nothing)."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from posttrain.conf import CONFIG_DIR
from posttrain.errors import ConfigError
from posttrain.prepare.cache import SFT_ENTRIES, built_once, code_version
from posttrain.prepare.pinned import pin_kernels, runs_pinned, train_pinned

# The recipe's `run(cfg, announce=False)`: trains the SFT config and returns its summary.
Train = Callable[..., dict]

log = logging.getLogger("posttrain")


# rollout settings of an online update, and their values when off (the SFT runs made for an RL
# run reset them: config/rollout.py refuses them on an algorithm without rollout batches)
ONLINE_ROLLOUT_KEYS = {"correction.tis": None, "correction.mis": None, "mismatch_budget.kl": None,
                       "mismatch_budget.masked_frac": None, "max_staleness": 0, "producer": None,
                       "partial_budget": None}


def warm_start(cfg: DictConfig, train: Train) -> str | None:
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
    return cached_sft_model(sft_cfg, target, "Warm start", train)


def cached_sft_model(sft_cfg: DictConfig, target: Path, label: str, train: Train) -> str:
    """The Hugging Face export of the SFT run `sft_cfg` (from `sft_plan`), trained once into
    the cache entry `target`. `label` names it in the log ("Warm start", "Teacher tiny_verbose")."""
    return built_once(target, lambda scratch: train_warm_start(sft_cfg, target, scratch, label, train), label)


def train_warm_start(sft_cfg: DictConfig, target: Path, scratch: Path, label: str, train: Train) -> None:
    """Train the SFT run `sft_cfg` (a warm start, an embedded teacher) into `scratch`; `built_once`
    renames it to `target`. Called with the cache lock held."""
    steps, target_accuracy = sft_cfg.trainer.max_steps, sft_cfg.callbacks.stop_at_accuracy
    goal = " for" if target_accuracy is None else f" until held-out accuracy >= {target_accuracy:.0%}, for at most"
    log.info(f"{label}: SFT{goal} {steps} steps, cached at {target}")
    sft_cfg = sft_cfg.copy()
    with open_dict(sft_cfg):
        sft_cfg.paths.output_dir = str(scratch)
    if runs_pinned(sft_cfg):  # the same weights on every machine: prepare/pinned.py
        train_pinned(train, sft_cfg, label)
    else:
        train(sft_cfg, announce=False)
    summary = json.loads((scratch / "summary.json").read_text())
    log.info(f"{label}: stopped at step {summary['global_step']}, "
             f"held-out accuracy {summary.get('eval/accuracy', float('nan')):.1%}")


def warm_start_plan(cfg: DictConfig) -> tuple[DictConfig, Path] | None:
    """The warm start's SFT config and its cache directory, or None when the run has none."""
    settings = cfg.algorithm.get("warm_start")
    if cfg.algorithm.kind not in ("online", "preference", "process") or not settings or settings.steps <= 0:
        return None
    if cfg.model.init_from:
        return None  # (a resumed run finds its warm start in the cache: its frozen roles start there)
    if cfg.model.name_or_path and not settings.get("pretrained", False):
        # a pretrained policy starts from its own weights: the warm start's settings (3000
        # steps at lr 3e-3) are the embedded model's, and would wreck an instruct model
        # (`warm_start.pretrained: true` with its own steps and lr asks for one all the same)
        return None
    return sft_plan(cfg, settings, "algorithm.warm_start", "warm_start")


def sft_plan(cfg: DictConfig, settings: DictConfig, key: str, folder: str) -> tuple[DictConfig, Path]:
    """An SFT run of `cfg`'s model on `cfg`'s task, as `settings` (the node at config `key`:
    steps, seed, until_accuracy, eval_every, lr, batch_size) say, and its cache directory
    `paths.cache_dir/<folder>/<key of what it depends on>`. The key holds only what the SFT
    run reads (never run paths, never the RL settings), so every online preset and every seed
    of a sweep share one entry."""
    target_accuracy = settings.get("until_accuracy")
    if target_accuracy is not None and not 0.0 < target_accuracy <= 1.0:
        raise ConfigError(f"{key}.until_accuracy={target_accuracy} must lie in (0, 1]")
    sft = OmegaConf.load(Path(CONFIG_DIR) / "algorithm" / "sft.yaml")
    sft.optim.lr, sft.batch_size = settings.lr, settings.batch_size
    sft_cfg = cfg.copy()
    with open_dict(sft_cfg):
        sft_cfg.algorithm = sft
        sft_cfg.teacher = None  # the SFT run distils nothing (and must not train the run's teacher itself)
        if sft_cfg.model.get("lora") is not None:
            # every weight trains in the warm start: it is the starting point (the base of a LoRA
            # run), the same with or without an adapter, and one cache entry serves both
            sft_cfg.model.lora.r = None
        # the warm start's own seed (data order, init) so a seed sweep shares one start
        sft_cfg.seed = cfg.seed if settings.get("seed") is None else settings.seed
        if "seed" in sft_cfg.data:
            sft_cfg.data.seed = sft_cfg.seed
        for group in ("advantage", "kl_estimator", "data_curriculum"):
            sft_cfg[group] = {"name": "none"}
        if not settings.get("with_env", False):  # the task's reference responses, not worked episodes
            sft_cfg.env = {"name": "none", "_target_": None}
        # how the RL run collects and corrects its rollout batches: an SFT run samples none
        for key, off in ONLINE_ROLLOUT_KEYS.items():
            if OmegaConf.select(sft_cfg, f"rollout.{key}") is not None:
                OmegaConf.update(sft_cfg, f"rollout.{key}", off)
        # one process trains it, whatever the RL run's parallelism: trainer=ddp shares trainer=cpu's
        sft_cfg.trainer.devices = 1
        if runs_pinned(sft_cfg):
            pin_kernels(sft_cfg)
        sft_cfg.trainer.pop("num_nodes", None)  # more than one node would make Lightning join the job's ranks
        sft_cfg.trainer.pop("strategy", None)
        sft_cfg.trainer.max_steps = settings.steps
        # a sweep's budget in rollout batches (sweeps/: one epoch of limit_train_batches) is
        # the RL run's, not the warm start's
        sft_cfg.trainer.pop("limit_train_batches", None)
        sft_cfg.trainer.pop("max_epochs", None)
        sft_cfg.trainer.pop("max_time", None)  # a time budget is the RL run's too: a cut warm start would be cached
        sft_cfg.trainer.val_check_interval = settings.steps if target_accuracy is None else settings.eval_every
        sft_cfg.callbacks.checkpoint.every_n_train_steps = settings.steps
        sft_cfg.callbacks.stop_at_step = None
        sft_cfg.ckpt_path = None  # the RL run's checkpoint is not the warm start's
        sft_cfg.callbacks.stop_at_accuracy = target_accuracy
        sft_cfg.callbacks.extra = []  # the user's callbacks watch their own run, not a cached prerequisite
        if not sys.stdout.isatty():  # a log file gets its two lines, not a line per eval
            sft_cfg.callbacks.progress_bar = "none"
        sft_cfg.eval.at_start = False
        if "panel" in sft_cfg.eval:  # the prompt panel is for comparing runs, not their cached start
            sft_cfg.eval.panel.size, sft_cfg.eval.panel.file = 0, None
        if "suites" in sft_cfg.eval:  # so are the evaluation suites
            sft_cfg.eval.suites = None
        sft_cfg.logger = {"backend": "none"}
    identity_cfg = OmegaConf.masked_copy(sft_cfg, ["algorithm", "model", "data", "seed", "trainer", "eval", "env"])
    identity_cfg.stop_at_accuracy = target_accuracy
    identity_cfg.code = code_version(sft_entries(sft_cfg))
    if "default_root_dir" in identity_cfg.trainer:  # the run dir must not change the key (del: it is not resolved)
        del identity_cfg.trainer["default_root_dir"]
    identity_cfg.model.pop("lora", None)  # off in the warm start, whatever the RL run's adapter
    identity_cfg.eval.pop("panel", None)  # off in the warm start, whatever the RL run's panel
    identity_cfg.eval.pop("suites", None)  # off in the warm start, whatever the RL run's suites
    identity = OmegaConf.to_yaml(identity_cfg)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return sft_cfg, Path(cfg.paths.cache_dir) / folder / digest




def sft_entries(sft_cfg: DictConfig) -> tuple[str, ...]:
    """The modules the SFT run `sft_cfg` executes, where the import closure of its cache key
    starts: the recipe, and the posttrain modules of the `_target_`s it instantiates (the
    algorithm's module, a trainer's strategy), which no import statement names."""
    targets = set()

    def visit(node) -> None:
        if isinstance(node, dict):
            target = node.get("_target_")
            if isinstance(target, str) and target.startswith("posttrain."):
                targets.add(target.rpartition(".")[0])
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    for group in ("algorithm", "trainer", "env"):  # resolved in place: an interpolation may point outside the group
        visit(OmegaConf.to_container(sft_cfg[group], resolve=True))
    return tuple(dict.fromkeys([*SFT_ENTRIES, *sorted(targets)]))
