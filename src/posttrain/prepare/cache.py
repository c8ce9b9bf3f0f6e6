"""One cache for everything made once before training (warm starts, teachers, preference pairs,
step rows), under `paths.cache_dir`: an entry is built whole or not at all, by one job and one
rank, while the others wait.

Many jobs of a sweep (a SLURM array) may start at the same moment with the same uncached entry:
the first takes a lock beside the cache entry and builds it, the others wait on that lock and
then read the cache. The lock is `fcntl.flock`: the kernel releases it when its holder dies, so a
crashed or killed job never blocks the others (they take the lock and build it themselves). It
works across the nodes of a cluster where the shared file system supports locks (NFS with lockd,
the usual case; Lustre mounted with `-o flock`, not `localflock`); on one without, the job stops
with an error naming paths.cache_dir.

In a multi-process job (torchrun, a SLURM job with a task per device) only global rank 0 takes
part in this: it builds the entry in its own process, before the job's process group exists,
while the other ranks wait for the cache entry, then every rank loads it."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from posttrain.distributed.collectives import job_rank_and_size
from posttrain.errors import CheckpointError, ConfigError
from posttrain.prepare.source_key import PACKAGE, source_digest

log = logging.getLogger("posttrain")


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


# How long the other ranks of a job wait for their rank 0 to take the warm start's lock (or find
# another job holding it) before they conclude that it failed: rank 0 takes it within seconds
# of starting; without a limit they would wait for the job's time limit.
RANK_ZERO_START_S = 300.0


POLL_S = 1.0


def wait_for_rank_zero(target: Path, rank: int, world: int, label: str = "Warm start") -> None:
    """Wait until the cache holds `target` (rank 0 of this job trains it, or another job of the
    sweep does: rank 0 then waits on the lock). Stops with an error when nobody has held the
    lock, and the entry is still missing, for RANK_ZERO_START_S: rank 0 failed or was killed."""
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


# The modules an SFT run executes, where its import closure starts (prepare/source_key.py): the
# recipe, whose `run` trains it, and the SFT module its config instantiates.
SFT_ENTRIES = ("posttrain.train", "posttrain.algorithms.sft")


@functools.cache
def code_version(entries: tuple[str, ...] = SFT_ENTRIES, root: Path = PACKAGE) -> str:
    """The code a warm start was trained with, for its cache key: posttrain's version, the
    versions of the libraries whose numerics it depends on, and a hash of the contents of the
    source files the SFT run depends on: the import closure of `entries` under `root` (a copy of
    src/posttrain in tests), as prepare/source_key.py reads it. Editing a policy loss, a reward,
    the RL module or a config rule leaves it unchanged; editing the SFT module, the model, the
    data, the sampler of its held-out eval or the recipe changes it. A content hash rather than
    the git commit: it changes with uncommitted edits (a commit hash would not), stays the same
    across commits that touch no such file, and needs no git checkout (an installed package, a
    copy on a cluster)."""
    import lightning  # start-up: the versions are read only when a cache key is made
    import torch
    import transformers

    try:
        release = version("posttrain")
    except PackageNotFoundError:  # a checkout on the path, not installed
        release = "unreleased"
    return (f"posttrain {release} source {source_digest(entries, root)[:16]} torch {torch.__version__} "
            f"transformers {transformers.__version__} lightning {lightning.__version__}")
