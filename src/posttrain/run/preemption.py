"""Pre-emption and time limits, owned in one place.

A scheduler tells a job that it is about to lose its allocation with a signal:

- SIGUSR1 / SIGUSR2: the warning before a time limit or a pre-emption (`sbatch
  --signal=USR2@<seconds>`, which the submitit launcher sets; USR1 is Lightning's and many
  sites' choice). The run checkpoints, asks SLURM to requeue the job, and exits non-zero;
  the requeued job runs the same command in the same run directory, and `ckpt_path=auto`
  continues from that checkpoint (and the same W&B run: tracking.wandb_run_id).
- SIGTERM: `scancel`, the end of a pre-emption's grace time, a machine shutting down. The
  run checkpoints and exits non-zero, without requeueing (a cancelled job stays cancelled;
  SLURM requeues a pre-empted job itself when its PreemptMode says so).

`Preemption` is the only handler of these signals during a run. submitit's own handler
(which requeues and `sys.exit`s from inside the signal handler, in the middle of a step)
and Lightning's (SIGTERM: stops with exit code 0 and no checkpoint; SLURM auto-requeue on
SIGUSR1) are replaced: see `Preemption.take_over` and `cluster_plugins`.

`AtomicCheckpointIO` writes every checkpoint to a temporary file beside it, fsyncs it and
renames it into place, so a kill during a save never leaves a truncated `.ckpt`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from pathlib import Path

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO

from posttrain.errors import PreemptedError

log = logging.getLogger("posttrain")

REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
STOP_SIGNALS = (signal.SIGTERM,)
# submitit's local executor restarts a job's tasks when one exits with this code (its
# stand-in for `scontrol requeue`; submitit.local.local.LOCAL_REQUEUE_RETURN_CODE)
SUBMITIT_LOCAL_REQUEUE_CODE = 144


class Preemption(Callback):
    """On SIGTERM / SIGUSR1 / SIGUSR2: at the end of the current training step (the first
    point where model, optimiser, data position and curriculum agree), write
    `<checkpoint_dir>/last.ckpt`, requeue the job after a warning signal, and raise
    PreemptedError, which ends the process with a non-zero code.

    The handler itself only notes the signal: anything more (saving, collectives, exiting)
    inside a signal handler would run in the middle of whatever the process was doing."""

    def __init__(self, checkpoint_dir: str | Path):
        self.checkpoint_dir = Path(checkpoint_dir)
        self.received: int | None = None
        # the handlers before ours (default, or submitit's), given back when the trainer is done
        on_main_thread = threading.current_thread() is threading.main_thread()
        self.previous = {s: signal.getsignal(s) for s in REQUEUE_SIGNALS + STOP_SIGNALS} if on_main_thread else {}
        self.take_over()

    # --- the signal handlers -----------------------------------------------------------------
    def take_over(self) -> None:
        """Install our handler for every signal we own. Called again when training and each
        evaluation start, because Lightning installs its own SIGTERM handler at each fit /
        validate, after the callbacks' setup."""
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only; handlers can only be set there
        for signum in REQUEUE_SIGNALS + STOP_SIGNALS:
            signal.signal(signum, self._note)

    def give_back(self) -> None:
        """Restore the handlers from before: a process that runs several jobs (a local sweep,
        the tests) must not keep a finished job's handler."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self.previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    def _note(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum

    def on_train_start(self, trainer, pl_module) -> None:
        self.take_over()

    def on_validation_start(self, trainer, pl_module) -> None:
        self.take_over()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.give_back()  # after fit (and after each validate outside it): the run is past training

    # --- the safe point ------------------------------------------------------------------------
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        signum = self.agreed_signal(trainer)
        if signum is None:
            return
        path = self.checkpoint_dir / "last.ckpt"
        trainer.save_checkpoint(path)  # every rank takes part; rank 0 writes (atomically)
        requeued = None
        if signum in REQUEUE_SIGNALS and trainer.is_global_zero:
            requeued = requeue_job()
        name = signal.Signals(signum).name
        if trainer.is_global_zero:
            then = (f"the job was requeued ({requeued}): it resumes from this checkpoint by itself" if requeued
                    else f"resume with: posttrain resume={self.checkpoint_dir.parent}")
            log.warning(f"posttrain: {name} received; stopped at step {trainer.global_step} with a checkpoint at "
                        f"{path}; {then}")
        local_requeue = signum in REQUEUE_SIGNALS and os.environ.get("SUBMITIT_EXECUTOR") == "local"
        raise PreemptedError(f"stopped by {name} at step {trainer.global_step}; checkpoint {path}",
                             exit_code=SUBMITIT_LOCAL_REQUEUE_CODE if local_requeue else 128 + signum)

    def agreed_signal(self, trainer) -> int | None:
        """The signal this step stops for, the same on every rank: saving a checkpoint is a
        collective operation, so all ranks stop when any rank was signalled. (A scheduler sends
        one signal to every task; should ranks differ, the largest signal number is taken.)"""
        local = self.received or 0
        if torch.distributed.is_available() and torch.distributed.is_initialized() and trainer.world_size > 1:
            flag = torch.tensor([local], device=trainer.strategy.root_device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            local = int(flag.item())
        return local or None


def requeue_job() -> str | None:
    """Put this job back in the queue; returns the job id (or 'submitit local'), or None when
    the process is not a scheduler's job or the scheduler refused."""
    if os.environ.get("SUBMITIT_EXECUTOR") == "local":
        return "submitit local"  # its controller restarts the tasks on our exit code
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{array_job}_{array_task}" if array_job and array_task else os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning(f"posttrain: could not requeue SLURM job {job_id}: {err}")
        return None
    if result.returncode != 0:
        log.warning(f"posttrain: `scontrol requeue {job_id}` failed: {result.stderr.strip()}")
        return None
    return job_id


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save into `.<name>.<pid>.tmp` beside the target, fsync, then rename over it.

    Lightning's own save writes a temporary file in /tmp and moves it, which across file
    systems is a copy: a kill during it leaves a truncated file under the final name. A
    rename within one directory is atomic; the directory's fsync makes the rename durable."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO.save_checkpoint takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # not *.ckpt: never picked by resume; one a kill left is removed at the next start
        # (checkpoints.INTERRUPTED_SAVES)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


class SubmititLocalEnvironment(ClusterEnvironment):
    """Ranks of a job of submitit's local executor (`hydra/launcher=submitit_local` with
    `tasks_per_node` > 1): one process per task, started by submitit, never by Lightning."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        # the same on every task of the job, different between jobs: the job id is the controller's pid
        return 20000 + int(os.environ["SUBMITIT_LOCAL_JOB_ID"]) % 20000

    @staticmethod
    def detect() -> bool:
        return os.environ.get("SUBMITIT_EXECUTOR") == "local" and "SUBMITIT_LOCAL_GLOBALID" in os.environ

    def world_size(self) -> int:
        return int(os.environ["SUBMITIT_LOCAL_NTASKS"])

    def set_world_size(self, size: int) -> None:
        pass  # fixed by the job

    def global_rank(self) -> int:
        return int(os.environ["SUBMITIT_LOCAL_GLOBALID"])

    def set_global_rank(self, rank: int) -> None:
        pass  # fixed by the job

    def local_rank(self) -> int:
        return int(os.environ["SUBMITIT_LOCAL_LOCALID"])

    def node_rank(self) -> int:
        return 0


def cluster_plugins() -> list:
    """Trainer plugins: atomic checkpoint files everywhere; inside a SLURM job, the SLURM
    environment with Lightning's own auto-requeue off (Preemption owns the signals); inside a
    submitit local job, its ranks."""
    plugins: list = [AtomicCheckpointIO()]
    if SubmititLocalEnvironment.detect():
        plugins.append(SubmititLocalEnvironment())
    elif SLURMEnvironment.detect():
        plugins.append(SLURMEnvironment(auto_requeue=False))
    return plugins
