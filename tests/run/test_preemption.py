"""Pre-emption and exact resume: a run killed (-9), stopped by SIGTERM or SIGUSR1, or
requeued by submitit continues where it stopped, and every step it logs after that equals
the uninterrupted run's; checkpoints are written atomically and resume skips broken ones."""

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from forked_cli import ForkedJob, ForkedProcess, start_command

from posttrain.run.checkpoints import checkpoint_step as library_checkpoint_step
from posttrain.run.checkpoints import newest_intact_checkpoint, resolve_ckpt_path
from posttrain.errors import CheckpointError
from posttrain.run.preemption import AtomicCheckpointIO

# GRPO with dynamic sampling (its extra rounds and dropped groups are curriculum state) on
# the easy task from the shared SFT start; evaluations and checkpoints every 4 steps
MAX_STEPS = 16
RUN = ["logger=csv", "callbacks.progress_bar=none", "algorithm=grpo", "data_curriculum=dynamic_sampling",
       "data.min_digits=2", "data.max_digits=2", "algorithm.prompts_per_step=2", "algorithm.group_size=4",
       "eval.at_start=false", "eval.num_prompts=16", "eval.batch_size=16", "trainer.val_check_interval=4",
       "callbacks.checkpoint.every_n_train_steps=4", f"trainer.max_steps={MAX_STEPS}", "num_threads=1"]


def start(run_dir: Path, sft_start: Path, *extra: str,
          launcher: tuple[str, ...] = (sys.executable,)) -> subprocess.Popen | ForkedProcess:
    """`posttrain` with RUN's overrides, as one process or under `launcher` (conftest.TORCHRUN)."""
    command = [*launcher, "-m", "posttrain.train", *RUN, f"model.init_from={sft_start}",
               f"hydra.run.dir={run_dir}", f"paths.log_dir={run_dir.parent}", *extra]
    return start_command(command)


def finish(process: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"the run ended before writing {path}:\n{finish(process)[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.1)


def logged(run_dir: Path) -> dict[tuple[int, str], str]:
    """(step, metric) -> value of the run's CSV log; a later row wins (a resumed run logs the
    steps after its checkpoint again). Timings differ between any two runs: left out."""
    values = {}
    with open(run_dir / "csv" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value != "" and key != "step" and not key.startswith("perf/"):
                    values[(int(row["step"]), key)] = value
    return values


def assert_continues_exactly(resumed_dir: Path, straight: dict, from_step: int) -> None:
    resumed = logged(resumed_dir)
    later = {key: value for key, value in straight.items() if key[0] >= from_step}
    assert later, "the uninterrupted run logged nothing after the resume point"
    missing = sorted(key for key in set(later) - set(resumed) if not repeats_previous(straight, key))
    assert not missing, f"the resumed run did not log {missing[:5]}"
    extra = sorted(key for key in resumed if key[0] >= from_step and key not in later)
    assert not extra, f"the resumed run logged what the uninterrupted one did not: {extra[:5]}"
    differ = [(key, resumed[key], later[key]) for key in sorted(later) if key in resumed and resumed[key] != later[key]]
    assert not differ, f"resumed != uninterrupted at (step, metric): {differ[:5]}"


def repeats_previous(values: dict, key: tuple[int, str]) -> bool:
    """Whether `values[key]` is the metric's value at its previous logged step. Lightning logs
    again, at every later batch, the last value of a metric a batch did not log (policy/* of
    a batch without a learning signal, which takes no step); a resumed process has no last
    value until its first update, so it leaves these repeats out."""
    step, name = key
    earlier = [s for s, n in values if n == name and s < step]
    return bool(earlier) and values[(max(earlier), name)] == values[key]


def checkpoint_step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


def first_logged_step_after(checkpoint: Path) -> int:
    """The CSV `step` of the first batch a run resumed from `checkpoint` logs. Rows are logged
    at Lightning's count of batches, not at the optimiser step (a batch without a learning
    signal takes no step); the checkpoint is taken before that count moves on."""
    sharded = checkpoint.is_dir()  # trainer=fsdp: a directory; its counters are in meta.pt
    loaded = torch.load(checkpoint / "meta.pt" if sharded else checkpoint, map_location="cpu", weights_only=False)
    return loaded["loops"]["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"] + 1


@pytest.fixture(scope="module")
def straight(sft_start, tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    code, output = finish(start(run_dir, sft_start))
    assert code == 0, output[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == MAX_STEPS
    return logged(run_dir)


def test_kill_9_mid_run_then_resume_logs_what_the_uninterrupted_run_logged(straight, sft_start, tmp_path):
    run_dir = tmp_path / "run"
    process = start(run_dir, sft_start)
    wait_for(run_dir / "checkpoints" / "step000004.ckpt", process)
    process.kill()  # at once: often while last.ckpt is written, or in the next step
    process.wait()
    resume_from = newest_intact_checkpoint(run_dir / "checkpoints")
    assert checkpoint_step(resume_from) < MAX_STEPS, "killed too late: nothing left to resume"
    from_step = first_logged_step_after(resume_from)
    # the requeued job's command: the same overrides, the same run dir, ckpt_path=auto (default)
    code, output = finish(start(run_dir, sft_start))
    assert code == 0, output[-3000:]
    assert f"resuming from {resume_from}" in (run_dir / "train.log").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == MAX_STEPS
    assert_continues_exactly(run_dir, straight, from_step)


# a job of 2 ranks: fewer steps (each costs two processes on this machine's cores), a checkpoint every 2
TWO_RANK_STEPS = 8


def kill_job(process: subprocess.Popen | ForkedJob) -> None:
    """SIGKILL every rank (and a real torchrun's launcher) at once, as a node failure or
    `scancel -s KILL` would (torchrun starts each rank in a session of its own: killing its
    process group is not enough)."""
    if isinstance(process, ForkedJob):
        process.kill()
    else:
        for pid in [*descendants(process.pid), process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    process.wait()


# a checkpoint file; a directory of shards (fsdp: 33 s, slow; its sharded resume runs in tests/distributed/test_fsdp.py)
@pytest.mark.parametrize("trainer", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_kill_9_of_a_two_rank_job_then_resume_logs_what_the_uninterrupted_job_logged(trainer, sft_start, tmp_path):
    from conftest import TORCHRUN

    job = (f"trainer={trainer}", f"trainer.max_steps={TWO_RANK_STEPS}", "callbacks.checkpoint.every_n_train_steps=2")
    code, output = finish(start(tmp_path / "straight", sft_start, *job, launcher=TORCHRUN), timeout=400)
    assert code == 0, output[-3000:]
    straight_job = logged(tmp_path / "straight")

    run_dir = tmp_path / "run"
    process = start(run_dir, sft_start, *job, launcher=TORCHRUN)
    try:
        wait_for(run_dir / "checkpoints" / "step000002.ckpt", process, timeout=300)
    finally:
        kill_job(process)
    resume_from = newest_intact_checkpoint(run_dir / "checkpoints")
    assert resume_from.is_dir() == (trainer == "fsdp")
    assert library_checkpoint_step(resume_from) < TWO_RANK_STEPS, "killed too late: nothing left to resume"
    from_step = first_logged_step_after(resume_from)
    code, output = finish(start(run_dir, sft_start, *job, launcher=TORCHRUN), timeout=400)  # the requeued job
    assert code == 0, output[-3000:]
    assert f"resuming from {resume_from}" in (run_dir / "train.log").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == TWO_RANK_STEPS
    assert_continues_exactly(run_dir, straight_job, from_step)


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGUSR1, marks=pytest.mark.slow)])  # one path
def test_a_signal_stops_the_run_with_a_checkpoint_and_a_non_zero_exit(signum, straight, sft_start, tmp_path):
    run_dir = tmp_path / "run"
    process = start(run_dir, sft_start)
    wait_for(run_dir / "checkpoints" / "step000004.ckpt", process)
    process.send_signal(signum)
    code, output = finish(process)
    assert code == 128 + signum, output[-3000:]
    name = signal.Signals(signum).name
    assert f"{name} received; stopped at step" in output, output[-3000:]
    stopped_at = int(output.split(f"{name} received; stopped at step ")[1].split()[0])
    last = run_dir / "checkpoints" / "last.ckpt"
    assert checkpoint_step(last) == stopped_at  # taken at the signal, not at the last periodic save
    assert 4 <= stopped_at < MAX_STEPS
    assert not (run_dir / "summary.json").exists()  # not finished
    from_step = first_logged_step_after(last)

    code, output = finish(start(run_dir, sft_start))  # a requeued job: same command, same dir
    assert code == 0, output[-3000:]
    assert f"resuming from {last}" in (run_dir / "train.log").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == MAX_STEPS
    assert_continues_exactly(run_dir, straight, from_step)


# --- which checkpoint `last` and `auto` pick ------------------------------------------------------
def save(path: Path, step: int) -> None:
    AtomicCheckpointIO().save_checkpoint({"global_step": step, "state_dict": {"w": torch.ones(3)}}, path)


def test_last_and_auto_pick_the_newest_intact_checkpoint(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    assert resolve_ckpt_path("auto", tmp_path) is None  # a new run dir: a fresh start
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        resolve_ckpt_path("last", tmp_path)
    save(checkpoints / "step000004.ckpt", 4)
    # killed between the periodic checkpoint and last.ckpt: the periodic one is found
    assert resolve_ckpt_path("last", tmp_path) == str(checkpoints / "step000004.ckpt")
    save(checkpoints / "last.ckpt", 6)  # a checkpoint taken at a signal
    save(checkpoints / "step000008.ckpt", 8)
    whole = (checkpoints / "step000008.ckpt").read_bytes()
    (checkpoints / "last.ckpt").write_bytes(whole[: len(whole) // 2])  # a newer last.ckpt, cut short by a kill
    (checkpoints / "step000012.ckpt").write_bytes(b"")  # an empty file
    assert resolve_ckpt_path("auto", tmp_path) == str(checkpoints / "step000008.ckpt")
    assert resolve_ckpt_path("last", tmp_path) == str(checkpoints / "step000008.ckpt")
    assert resolve_ckpt_path(str(checkpoints / "step000004.ckpt"), tmp_path) == str(checkpoints / "step000004.ckpt")
    # sharded checkpoints (trainer=fsdp) are directories, finished when rank 0 writes meta.pt
    (checkpoints / "step000016.ckpt").mkdir()
    torch.save({"global_step": 16}, checkpoints / "step000016.ckpt" / "meta.pt")
    (checkpoints / "step000020.ckpt").mkdir()  # shards being written: no meta.pt yet
    assert resolve_ckpt_path("auto", tmp_path) == str(checkpoints / "step000016.ckpt")


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("killed mid-save")


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_partial_file(tmp_path):
    path = tmp_path / "checkpoints" / "last.ckpt"
    save(path, 4)
    with pytest.raises(RuntimeError, match="killed mid-save"):
        AtomicCheckpointIO().save_checkpoint({"global_step": 8, "state_dict": {"w": torch.ones(3)},
                                              "bad": Unpicklable()}, path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]
    assert checkpoint_step(path) == 4


# --- SLURM launcher presets ------------------------------------------------------------------------
def launcher_settings(*overrides: str) -> dict:
    from omegaconf import OmegaConf

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from posttrain.conf import CONFIG_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
    return OmegaConf.to_container(cfg.hydra.launcher, resolve=False) | {
        key: OmegaConf.select(cfg, f"hydra.launcher.{key}") for key in ("tasks_per_node", "gpus_per_node", "nodes")}


def test_slurm_presets_take_tasks_and_nodes_from_the_trainer():
    from submitit.slurm.slurm import _make_sbatch_string

    one_node = launcher_settings("hydra/launcher=slurm", "trainer=ddp", "trainer.devices=4",
                                 "hydra.launcher.partition=gpu")
    assert (one_node["tasks_per_node"], one_node["gpus_per_node"], one_node["nodes"]) == (4, 4, 1)
    multi = launcher_settings("hydra/launcher=slurm_multinode", "trainer=ddp", "trainer.devices=8",
                              "+trainer.num_nodes=2")
    assert (multi["tasks_per_node"], multi["gpus_per_node"], multi["nodes"]) == (8, 8, 2)
    # the sbatch script submitit writes for the one-node preset (as the launcher passes it)
    script = _make_sbatch_string(
        command="python -m submitit.core._submit /tmp", folder="/tmp/%j", job_name="posttrain",
        partition="gpu", ntasks_per_node=4, gpus_per_node=4, nodes=1, cpus_per_task=one_node["cpus_per_task"],
        mem="64GB", time=one_node["timeout_min"], signal_delay_s=one_node["signal_delay_s"],
        additional_parameters=one_node["additional_parameters"])
    for line in ("--ntasks-per-node=4", "--gpus-per-node=4", "--nodes=1", "--signal=USR2@300", "--requeue",
                 "--partition=gpu"):
        assert f"#SBATCH {line}" in script, script


# --- submitit: 2 tasks, a warning signal, the job restarted in place -------------------------------
def descendants(pid: int) -> list[int]:
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def submitit_tasks(pid: int) -> list[int]:
    """The processes of the job's tasks (not their own children, such as W&B's service)."""
    tasks = []
    for child in descendants(pid):
        try:
            if b"submitit.core._submit" in Path(f"/proc/{child}/cmdline").read_bytes():
                tasks.append(child)
        except OSError:
            continue
    return tasks


def submitit_sweep(tmp_path: Path, sft_start: Path, *extra: str) -> subprocess.Popen | ForkedProcess:
    """`posttrain -m hydra/launcher=submitit_local_tasks ...`: the SLURM launch path without SLURM
    (tasks_per_node = trainer.devices, ranks from submitit's environment, never from Lightning)."""
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    command = [sys.executable, "-m", "posttrain.train", "-m", "hydra/launcher=submitit_local_tasks",
               "callbacks.progress_bar=none", "algorithm=grpo", f"model.init_from={sft_start}",
               "data.min_digits=2", "data.max_digits=2", "algorithm.prompts_per_step=2", "algorithm.group_size=4",
               "eval.at_start=false", "eval.num_prompts=16", "eval.batch_size=16", "trainer.val_check_interval=4",
               "callbacks.checkpoint.every_n_train_steps=4", "num_threads=1", f"paths.log_dir={tmp_path}", *extra]
    return start_command(command, env=env)


@pytest.mark.slow  # 28 s; CI keeps two ranks under ddp through kill -9 and resume
def test_submitit_job_of_two_tasks_trains_as_two_ranks(sft_start, tmp_path):
    code, output = finish(submitit_sweep(tmp_path, sft_start, "trainer=ddp", "logger=none", "trainer.max_steps=2"),
                          timeout=300)
    assert code == 0, output[-3000:]
    (run_dir,) = tmp_path.glob("multiruns/*/0_grpo")
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == 2
    (task_log,) = run_dir.parent.glob(".submitit/*/*_1_log.out")  # submitit's log of the second task
    assert "global_rank=1(2)" in task_log.read_text()


@pytest.mark.slow  # 27 s; CI keeps the signal's checkpoint and exit (SIGTERM above) and kill -9 resumes
def test_submitit_job_is_requeued_on_the_warning_signal_and_continues_its_run(sft_start, tmp_path):
    """SIGUSR2 (what SLURM sends before the time limit) -> checkpoint, exit code 144 (submitit's
    local stand-in for `scontrol requeue`) -> the same job runs again in the same run dir,
    continues from the checkpoint, and logs into the same W&B run."""
    process = submitit_sweep(tmp_path, sft_start, "logger=wandb", "trainer.max_steps=8")
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob("multiruns/*/0_grpo/checkpoints/step000004.ckpt")):
            assert process.poll() is None, finish(process)[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        tasks = submitit_tasks(process.pid)
        assert len(tasks) == 1, tasks
        os.kill(tasks[0], signal.SIGUSR2)
        code, output = finish(process, timeout=300)
    finally:
        if process.poll() is None:  # a failed assertion above: end the sweep, its controller and task
            for pid in descendants(process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.kill()
    assert code == 0, output[-3000:]
    (run_dir,) = tmp_path.glob("multiruns/*/0_grpo")
    log = (run_dir / "train.log").read_text()
    assert "SIGUSR2 received; stopped at step" in log and "requeued (submitit local)" in log, log[-3000:]
    assert f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'}" in log
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == 8
    # both starts of the job logged into one W&B run, the one recorded in the run dir
    run_id = (run_dir / "wandb_run_id.txt").read_text().strip()
    offline_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2 and all(p.name.endswith(f"-{run_id}") for p in offline_runs), offline_runs
