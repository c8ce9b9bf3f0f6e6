"""The SFT warm start of an online run: planned from the run's config, trained once (by the
entry point's own `run`), cached under a key of what it depends on, shared by every run.
The embedded teachers of distillation (models/teacher.py) are SFT runs cached the same way:
`sft_plan` and `cached_sft_model` serve both.

Many jobs of a sweep (a SLURM array) may start at the same moment with the same uncached warm
start: the first takes a lock beside the cache entry and trains it, the others wait on that
lock and then read the cache. The lock is `fcntl.flock`: the kernel releases it when its
holder dies, so a crashed or killed job never blocks the others (they take the lock and
train it themselves). It works across the nodes of a cluster where the shared file system
supports locks (NFS with lockd, the usual case; Lustre mounted with `-o flock`, not
`localflock`); on one without, the job stops with an error naming paths.cache_dir.

In a multi-process job (torchrun, a SLURM job with a task per device) only global rank 0
takes part in this: it trains the warm start in its own process, before the job's process
group exists (its trainer has one device and no strategy, so it joins nothing), while the
other ranks wait for the cache entry, then every rank loads it."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from posttrain.errors import CheckpointError, ConfigError

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
    return cached_sft_model(sft_cfg, target, "Warm start")


def cached_sft_model(sft_cfg: DictConfig, target: Path, label: str) -> str:
    """The Hugging Face export of the SFT run `sft_cfg` (from `sft_plan`), trained once into
    the cache entry `target`. `label` names it in the log ("Warm start", "Teacher tiny_verbose")."""
    return built_once(target, lambda scratch: train_warm_start(sft_cfg, target, scratch, label), label)


def built_once(target: Path, build: Callable[[Path], None], label: str) -> str:
    """`<target>/hf_model`, made once for every job and rank that asks for it: `build(scratch)`
    writes the whole entry (its hf_model/ included) into a scratch directory beside `target`,
    which is then renamed into place, so the cache holds whole entries only. Jobs of a sweep
    wait on the entry's lock while one builds it; in a multi-process job rank 0 builds it and
    the other ranks wait for it (see the module's docstring)."""
    if (target / "hf_model").is_dir():
        return str(target / "hf_model")
    rank, world = job_rank_and_size()
    if rank != 0:
        # a rank of a multi-process job (torchrun, a SLURM job's task): its rank 0 builds the
        # entry, alone, before any process group exists; the others wait for it
        wait_for_rank_zero(target, rank, world, label)
        return str(target / "hf_model")
    with cache_lock(target, label) as lock_path:
        if (target / "hf_model").is_dir():  # another job of the sweep built it while this one waited
            log.info(f"{label}: trained by another job, read from {target}")
        else:
            # what a killed holder left (its scratch directory, or an entry without hf_model)
            # is nobody's now: the lock is ours
            for leftover in target.parent.glob(f".{target.name}.*.tmp"):
                shutil.rmtree(leftover, ignore_errors=True)
            if target.exists():
                shutil.rmtree(target)
            scratch = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            build(scratch)
            os.replace(scratch, target)
        # The cache keeps entries only. Safe while held: the entry is in place, so a job that
        # locks the old file after us, or a new one after the unlink, finds it and builds nothing.
        lock_path.unlink(missing_ok=True)
    return str(target / "hf_model")


# Environment variables that give a process its global rank and the job's number of processes:
# torchrun (and Lightning's own launcher), a SLURM job's tasks, submitit's local executor.
RANK_VARIABLES = (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"),
                  ("SUBMITIT_LOCAL_GLOBALID", "SUBMITIT_LOCAL_NTASKS"))
# How long the other ranks of a job wait for their rank 0 to take the warm start's lock (or find
# another job holding it) before they conclude that it failed: rank 0 takes it within seconds
# of starting; without a limit they would wait for the job's time limit.
RANK_ZERO_START_S = 300.0
POLL_S = 1.0


def job_rank_and_size() -> tuple[int, int]:
    """(global rank, number of processes) of this process's job, from its launcher's
    environment; (0, 1) outside a multi-process job. Read before any process group exists."""
    for rank_name, size_name in RANK_VARIABLES:
        if rank_name in os.environ and size_name in os.environ:
            return int(os.environ[rank_name]), int(os.environ[size_name])
    return 0, 1


def wait_for_rank_zero(target: Path, rank: int, world: int, label: str = "Warm start") -> None:
    """Wait until the cache holds `target` (rank 0 of this job trains it, or another job of the
    sweep does: rank 0 then waits on the lock). Stops with an error when nobody has held the
    lock, and the entry is still missing, for RANK_ZERO_START_S: rank 0 failed or was killed."""
    import time

    log.info(f"{label}: rank {rank} of {world} waits for rank 0 to train it ({target})")
    lock_path = target.with_name(f"{target.name}.lock")
    free_since = time.monotonic()
    while not (target / "hf_model").is_dir():
        if lock_is_held(lock_path):
            free_since = time.monotonic()
        elif time.monotonic() - free_since > RANK_ZERO_START_S:
            raise CheckpointError(f"{label} {target} was not trained: rank 0 of this job has not held "
                                  f"its lock ({lock_path}) for {RANK_ZERO_START_S:.0f} s; see rank 0's error")
        time.sleep(POLL_S)


def lock_is_held(lock_path: Path) -> bool:
    """Whether a process holds the flock of `lock_path` now. The file is only opened (never
    created: the cache keeps entries only), and a free lock is released at once."""
    try:
        descriptor = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(descriptor, fcntl.LOCK_UN)
        return False
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def cache_lock(target: Path, label: str = "Warm start") -> Iterator[Path]:
    """Hold `<target>.lock` (beside the cache entry) exclusively: one job trains a cache entry
    (a warm start, a teacher), the others wait here. The holder's host and pid are written
    into the lock file so that a waiting job can say whom it waits for; the kernel drops the
    lock when the holder exits or dies, however it ends."""
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.with_name(f"{target.name}.lock")
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another job"
            log.info(f"{label}: waiting for {holder}, which is training it (lock {lock_path})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as err:  # ENOLCK: a file system without locks; training unlocked would race
            raise ConfigError(f"paths.cache_dir={target.parent.parent} cannot hold the lock of {label} ({err}); "
                              f"set paths.cache_dir to a directory on a file system with file locks") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
        lock.flush()
        try:
            yield lock_path
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def train_warm_start(sft_cfg: DictConfig, target: Path, scratch: Path, label: str = "Warm start") -> None:
    """Train the SFT run `sft_cfg` (a warm start, an embedded teacher) into `scratch`; `built_once`
    renames it to `target`. Called with the cache lock held."""
    steps, target_accuracy = sft_cfg.trainer.max_steps, sft_cfg.callbacks.stop_at_accuracy
    goal = " for" if target_accuracy is None else f" until held-out accuracy >= {target_accuracy:.0%}, for at most"
    log.info(f"{label}: SFT{goal} {steps} steps, cached at {target}")
    sft_cfg = sft_cfg.copy()
    with open_dict(sft_cfg):
        sft_cfg.paths.output_dir = str(scratch)
    from posttrain.train import run  # the entry point's own job, run for the SFT config

    summary = run(sft_cfg, announce=False)
    log.info(f"{label}: stopped at step {summary['global_step']}, "
             f"held-out accuracy {summary.get('eval/accuracy', float('nan')):.1%}")


def warm_start_plan(cfg: DictConfig) -> tuple[DictConfig, Path] | None:
    """The warm start's SFT config and its cache directory, or None when the run has none."""
    settings = cfg.algorithm.get("warm_start")
    if cfg.algorithm.kind not in ("online", "preference", "process") or not settings or settings.steps <= 0:
        return None
    if cfg.model.init_from:
        return None  # (a resumed run finds its warm start in the cache: its frozen roles start there)
    if cfg.model.name_or_path:
        # a pretrained policy starts from its own weights: the warm start's settings (3000
        # steps at lr 3e-3) are the embedded model's, and would wreck an instruct model
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
    from posttrain.train import CONFIG_DIR

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
        # one process trains it, whatever the RL run's parallelism: trainer=ddp shares trainer=cpu's
        sft_cfg.trainer.devices = 1
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
        if not sys.stdout.isatty():  # a log file gets its two lines, not a line per eval
            sft_cfg.callbacks.progress_bar = "none"
        sft_cfg.eval.at_start = False
        sft_cfg.logger = {"backend": "none"}
    identity_cfg = OmegaConf.masked_copy(sft_cfg, ["algorithm", "model", "data", "seed", "trainer", "eval"])
    identity_cfg.stop_at_accuracy = target_accuracy
    identity_cfg.code = code_version()
    identity_cfg.trainer.pop("default_root_dir", None)  # the run dir must not change the key
    identity_cfg.model.pop("lora", None)  # off in the warm start, whatever the RL run's adapter
    identity = OmegaConf.to_yaml(identity_cfg)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return sft_cfg, Path(cfg.paths.cache_dir) / folder / digest


# Source files an SFT run never imports (tests/test_sweeps.py checks it): the RL pipeline's
# own modules, the ones edited most while iterating on an algorithm. Editing them must not
# retrain every cached warm start; editing anything else (the model, data, SFT module,
# core, rollout used by its held-out eval, this file) does.
NOT_IN_SFT = ("algorithms/online.py", "algorithms/terms.py", "algorithms/experience.py", "models/roles.py",
              "evaluate.py", "algorithms/reward_model.py", "algorithms/preference.py", "data/preference.py",
              "models/teacher.py", "algorithms/prm.py", "data/process.py", "best_of_n.py")


@functools.cache
def code_version() -> str:
    """The code a warm start was trained with, for its cache key: posttrain's version, the
    versions of the libraries whose numerics it depends on, and a hash of the contents of
    posttrain's source files (those an SFT run imports). A content hash rather than the git
    commit: it changes with uncommitted edits (a commit hash would not), stays the same
    across commits that touch no such file (docs, configs of other runs, RL modules), and
    needs no git checkout (an installed package, a copy on a cluster)."""
    from importlib.metadata import PackageNotFoundError, version

    import lightning
    import torch
    import transformers

    package = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package).as_posix()
        if name not in NOT_IN_SFT:
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    try:
        release = version("posttrain")
    except PackageNotFoundError:  # a checkout on the path, not installed
        release = "unreleased"
    return (f"posttrain {release} source {digest.hexdigest()[:16]} torch {torch.__version__} "
            f"transformers {transformers.__version__} lightning {lightning.__version__}")
