"""Logging: one W&B run per job, and RL metrics for every rollout batch."""

import csv
import json
import struct
import time
from pathlib import Path

import pytest
import torch

from posttrain.train import run

from conftest import EASY_TASK, FAST_RUN

UNLOGGED_FAST_RUN = tuple(o for o in FAST_RUN if not o.startswith("logger="))


def wandb_records(run_dir: Path):
    """The protobuf records of an offline W&B run's .wandb file (a LevelDB-style log:
    a 7-byte file header, then 32 KiB blocks of chunks, each a 7-byte header
    (crc32, length, type 1 full / 2 first / 3 middle / 4 last) and its data)."""
    from wandb.proto import wandb_internal_pb2

    block, header = 32768, 7
    (path,) = run_dir.glob("*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = header, b""
    while pos + header <= len(data):
        if block - pos % block < header:  # a block's zero-padded tail
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        if kind == 0 or pos + header + length > len(data):  # the end, or a chunk still being written
            break
        pending += data[pos + header:pos + header + length]
        pos += header + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def offline_run(output_dir: Path, timeout: float = 30.0) -> dict:
    """The one offline W&B run under a job's run dir: id, config seed, history rows, exit code.
    The W&B service writes the file in the background and may flush it a moment after
    `finish()` has returned: read until its exit record is there."""
    run_dirs = list((output_dir / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1, run_dirs
    deadline = time.monotonic() + timeout
    while (found := read_offline_run(run_dirs[0]))["exit_code"] is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def read_offline_run(run_dir: Path) -> dict:
    found = {"dir": run_dir, "history": [], "exit_code": None}
    for record in wandb_records(run_dir):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            found["id"] = record.run.run_id
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            found["seed"] = config["seed"]["value"] if isinstance(config["seed"], dict) else config["seed"]
        elif kind == "history":
            found["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                     for item in record.history.item})
        elif kind == "exit":
            found["exit_code"] = record.exit.exit_code
    return found


def sft_wandb_config(make_config, output_dir, seed, steps):
    return make_config(*UNLOGGED_FAST_RUN, *EASY_TASK, "logger=wandb", f"seed={seed}", f"trainer.max_steps={steps}",
                       "algorithm.batch_size=8", "eval.num_prompts=16", "trainer.val_check_interval=100",
                       "callbacks.checkpoint.every_n_train_steps=100", "eval.at_start=false", output_dir=output_dir)


def test_each_job_in_one_process_gets_its_own_wandb_run(make_config, tmp_path, monkeypatch):
    """A local multirun (basic launcher) runs its jobs one after another in one process:
    each must log into a run of its own, finished when its job ends."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    jobs = {"a": (0, 2), "b": (1, 3)}  # run dir: (seed, optimiser steps)
    for name, (seed, steps) in jobs.items():
        run(sft_wandb_config(make_config, tmp_path / name, seed, steps))
        assert wandb.run is None  # finished with its job, not left for the next to reuse
    runs = {name: offline_run(tmp_path / name) for name in jobs}
    assert runs["a"]["id"] != runs["b"]["id"]
    for name, (seed, steps) in jobs.items():
        found = runs[name]
        assert found["dir"].name.endswith(found["id"])
        assert found["seed"] == seed
        assert found["exit_code"] == 0
        losses = [row for row in found["history"] if "train/loss" in row]
        assert [row["trainer/global_step"] for row in losses] == list(range(steps)), name  # every step, only its own
        assert sum("eval/accuracy" in row for row in found["history"]) == 1


def test_a_failed_job_finishes_its_wandb_run_as_failed(make_config, tmp_path, monkeypatch):
    import wandb

    import posttrain.models.lora

    def disk_full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(posttrain.models.lora, "save_pretrained_atomic", disk_full)  # fails after training
    with pytest.raises(OSError, match="disk full"):
        run(sft_wandb_config(make_config, tmp_path, 0, 2))
    assert wandb.run is None
    found = offline_run(tmp_path)
    assert found["exit_code"] == 1, found
    assert sum("train/loss" in row for row in found["history"]) == 2, found


def test_rl_logs_every_rollout_batch(make_config, sft_start, tmp_path):
    """With two minibatches one rollout batch makes two optimiser steps: 6 steps are 3
    rollout batches, and with the default trainer config each has its row of rollout
    metrics, at the logged step of its rollout batch (docs/running.md, "Step counters")."""
    cfg = make_config(*UNLOGGED_FAST_RUN, *EASY_TASK, "logger=csv", f"model.init_from={sft_start}", "algorithm=grpo",
                      "algorithm.prompts_per_step=4", "algorithm.group_size=4", "algorithm.num_minibatches=2",
                      "trainer.max_steps=6", "trainer.val_check_interval=3",
                      "callbacks.checkpoint.every_n_train_steps=6", "eval.at_start=false")
    assert cfg.trainer.log_every_n_steps == 1
    summary = run(cfg)
    batches = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["train_batches_seen"]
    assert summary["global_step"] == 6
    assert batches == 3
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("rollout/reward_mean")]
    assert [int(row["step"]) for row in rows] == [0, 1, 2]  # one row per rollout batch, stepped by rollout batch
