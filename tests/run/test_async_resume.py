"""A run with a rollout producer process, killed (-9) mid-run, resumes without losing or
repeating a training batch: at staleness 0 with partial rollouts under way it logs what the
uninterrupted synchronous run logged (the responses under way are in the checkpoint); one
version ahead, the batch the producer had in flight is dropped and sampled again, from the
same prompts, with the resumed weights."""

import json

import psutil
import pytest
import torch
from test_preemption import (
    MAX_STEPS,
    assert_continues_exactly,
    checkpoint_step,
    finish,
    first_logged_step_after,
    logged,
    start,
    wait_for,
)

from posttrain.run.checkpoints import newest_intact_checkpoint

PARTIAL = ("rollout.partial_budget=2",)


@pytest.fixture(scope="module")
def straight_partial(sft_start, tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("straight_partial") / "run"
    code, output = finish(start(run_dir, sft_start, *PARTIAL))
    assert code == 0, output[-3000:]
    return logged(run_dir)


def kill_after_first_checkpoint(run_dir, process) -> None:
    """kill -9 once the step-4 checkpoint exists; the producer process, orphaned, must exit."""
    wait_for(run_dir / "checkpoints" / "step000004.ckpt", process)
    children = psutil.Process(process.pid).children(recursive=True)
    process.kill()
    process.wait()
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"producer processes outlived their trainer: {alive}"


@pytest.mark.slow  # 42 s; CI keeps the kill -9 of a producer ahead
def test_kill_9_with_a_producer_at_staleness_0_resumes_as_the_synchronous_run(straight_partial, sft_start, tmp_path):
    run_dir = tmp_path / "run"
    process = start(run_dir, sft_start, *PARTIAL, "rollout.producer=process")
    kill_after_first_checkpoint(run_dir, process)
    resume_from = newest_intact_checkpoint(run_dir / "checkpoints")
    assert checkpoint_step(resume_from) < MAX_STEPS, "killed too late: nothing left to resume"
    assert torch.load(resume_from, map_location="cpu", weights_only=False)["partial_rollouts"], \
        "the checkpoint lacks the responses under way"
    from_step = first_logged_step_after(resume_from)  # before the resumed run writes newer checkpoints
    code, output = finish(start(run_dir, sft_start, *PARTIAL, "rollout.producer=process"))
    assert code == 0, output[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == MAX_STEPS
    assert_continues_exactly(run_dir, straight_partial, from_step)


def test_kill_9_with_a_producer_ahead_neither_loses_nor_repeats_a_batch(sft_start, tmp_path):
    run_dir = tmp_path / "run"
    process = start(run_dir, sft_start, "rollout.max_staleness=1")
    kill_after_first_checkpoint(run_dir, process)
    resume_from = newest_intact_checkpoint(run_dir / "checkpoints")
    resumed_at = torch.load(resume_from, map_location="cpu", weights_only=False)["train_batches_seen"]
    code, output = finish(start(run_dir, sft_start, "rollout.max_staleness=1"))
    assert code == 0, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == MAX_STEPS
    # the resumed process consumed batches resumed_at + 1, ..., its last, each once, in order
    last = int(summary["rollout/batch"])
    batches = [json.loads(line)["rollout/batch"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if "rollout/batch" in json.loads(line)]
    assert last > resumed_at and batches[-(last - resumed_at):] == list(range(resumed_at + 1, last + 1))
