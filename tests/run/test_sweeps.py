"""The ready grids of sweeps/ and the warm start they share: each grid composes into the jobs
its header promises (a command-line axis replaces the file's), one runs end to end and
tabulates, and jobs that start the same uncached warm start at once train it once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from posttrain.prepare import warm_start as warm_start_module
from posttrain.config.check import check_config, keys_without_spec
from posttrain.conf import CONFIG_DIR
from posttrain.prepare.cache import cache_lock
from posttrain.prepare.warm_start import warm_start_plan

from forked_cli import run_command
from conftest import FAST_RUN, compose_config

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]

# study: (axes, number of jobs), as each file's header says
GRIDS = {
    "grpo_family": (["algorithm", "seed"], 18),
    "kl_estimators": (["kl_estimator", "kl_estimator.placement"], 10),
    "advantage_estimators": (["advantage", "seed"], 12),
    "grpo_vs_ppo": (["experiment", "seed"], 6),
    "prm_vs_outcome": (["experiment", "seed"], 6),
    "mismatch": (["rollout.dtype", "rollout.correction.tis", "seed"], 12),
    "staleness": (["rollout.max_staleness", "rollout.correction.tis", "seed"], 18),
    "warm_starts": (["algorithm.warm_start.seed", "seed"], 9),
    "presets": (["+preset", "algorithm.warm_start.seed", "seed"], 162),
}


def grid_jobs(study: str, *arguments: str) -> list[list[str]]:
    """Each job's overrides for `posttrain -m +sweep=<study> <arguments>`, as Hydra's basic
    sweeper makes them: the file's axes (hydra.sweeper.params) first, the command line after,
    a key given twice taking the later value."""
    parser = OverridesParser.create()
    fixed = [o.input_line for o in parser.parse_overrides(list(arguments)) if not o.is_sweep_override()]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):  # the sweep's own config
        master = compose("train", overrides=[f"+sweep={study}", *fixed], return_hydra_config=True)
    params = [f"{key}={value}" for key, value in master.hydra.sweeper.params.items()]
    overrides = parser.parse_overrides([*params, f"+sweep={study}", *arguments])
    (batch,) = BasicSweeper.split_arguments(overrides, None)
    return batch


def test_every_grid_file_is_tested():
    assert sorted(p.stem for p in (REPO / "sweeps").glob("*.yaml")) == sorted(GRIDS)


@pytest.mark.parametrize("study", sorted(GRIDS))
def test_each_grid_composes_into_its_jobs(study):
    """Every arm of the grid composes and passes validation, with the budget the header
    promises: the same rollout batches for each arm, and enough optimiser steps for all. An arm
    is composed with its first seed only: the other seeds' jobs differ from it in `seed=` alone."""
    axes, count = GRIDS[study]
    jobs = grid_jobs(study)
    assert len(jobs) == count
    assert [o.split("=")[0] for o in jobs[0][:len(axes)]] == axes
    assert len({tuple(job) for job in jobs}) == count
    arms = {tuple(o for o in job if not o.startswith("seed=")): job for job in reversed(jobs)}  # first seed wins
    assert len(arms) == count // (3 if "seed" in axes else 1)
    completions = set()
    for job in arms.values():
        cfg = compose_config(job)
        OmegaConf.resolve(cfg)
        check_config(cfg, {})
        assert keys_without_spec(cfg) == [], "add these keys to the SPECS of src/posttrain/config/"
        if "limit_train_batches" not in cfg.trainer:  # each arm keeps its preset's own budget (presets)
            continue
        batches = cfg.trainer.limit_train_batches
        assert cfg.trainer.max_epochs == 1
        assert cfg.trainer.max_steps >= batches * cfg.algorithm.ppo_epochs * cfg.algorithm.num_minibatches, job
        completions.add(cfg.algorithm.prompts_per_step * cfg.algorithm.group_size)
    assert len(completions) <= 1, f"{study}: arms sample {sorted(completions)} completions a batch: not an equal budget"


def test_the_main_jobs_batch_and_the_ablation_grids_batch():
    """experiment=grpo_tiny samples 32 prompts x 8 (docs/algorithms.md, "The batch's prompt count
    is the lever"); the ablation grids declare the 8 x 16 their budgets and figures were measured
    at, and grpo_vs_ppo runs GRPO at PPO's 32 x 4."""
    main = compose_config(["experiment=grpo_tiny"])
    assert (main.algorithm.prompts_per_step, main.algorithm.group_size, main.trainer.max_steps) == (32, 8, 500)
    for study in ("kl_estimators", "advantage_estimators", "grpo_family", "staleness", "mismatch"):
        cfg = compose_config(grid_jobs(study)[0])
        assert (cfg.algorithm.prompts_per_step, cfg.algorithm.group_size) == (8, 16), study
    arms = {next(o for o in job if o.startswith("experiment=")): job for job in grid_jobs("grpo_vs_ppo")}
    assert sorted(arms) == ["experiment=grpo_tiny", "experiment=ppo_tiny"]
    for job in arms.values():
        cfg = compose_config(job)
        assert (cfg.algorithm.prompts_per_step, cfg.algorithm.group_size) == (32, 4), job


def test_a_command_line_axis_replaces_the_files():
    jobs = grid_jobs("grpo_family", "seed=0")
    assert len(jobs) == 6 and all("seed=0" in job for job in jobs)
    jobs = grid_jobs("grpo_family", "algorithm=grpo,dapo", "trainer.limit_train_batches=500")
    assert len(jobs) == 6
    assert {o for job in jobs for o in job if o.startswith("algorithm=")} == {"algorithm=grpo", "algorithm=dapo"}
    cfg = compose_config(jobs[0])
    assert cfg.trainer.limit_train_batches == 500  # the full-size budget, by an override


def posttrain(*arguments: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_command([sys.executable, "-m", "posttrain.train", *arguments], capture_output=True, text=True,
                       timeout=600, cwd=cwd, env=env)


# A tiny warm start and budget: the grid's machinery, not its learning
TINY = ("logger=none", "callbacks.progress_bar=none", "eval.num_prompts=16", "eval.batch_size=16",
        "algorithm.prompts_per_step=2", "algorithm.group_size=4", "algorithm.warm_start.steps=6",
        "algorithm.warm_start.until_accuracy=null", "trainer.limit_train_batches=2", "trainer.val_check_interval=2",
        "model.hidden_size=32")


@pytest.mark.slow  # 13 s; the README's sweep and sweep_table.py run a grid end to end in CI
def test_a_grid_runs_end_to_end_and_tabulates(tmp_path):
    result = posttrain("-m", "+sweep=advantage_estimators", "advantage=group_norm,rloo", "seed=0", *TINY,
                       f"paths.log_dir={tmp_path}", cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Launching 2 jobs" in output
    assert output.count("Warm start: SFT") == 1  # trained by the first job, read by the second
    (sweep_dir,) = (tmp_path / "multiruns" / "advantage_estimators").iterdir()  # the study names the folder
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0_adv_group_norm", "1_adv_rloo"]
    summaries = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/summary.json"))]
    assert [s["global_step"] for s in summaries] == [2, 2]
    table = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sweep_table.py"), str(sweep_dir), "--markdown"],
                           capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    rows = [line for line in table.stdout.splitlines() if line.startswith("| ") and "acc start" not in line]
    assert len(rows) == 2 and "group_norm" in rows[0] and "rloo" in rows[1]


# One process of the concurrent warm-start test: compose, get ready, wait for the others'
# go, then ask for the warm start; prints the directory it got.
WARM_START_JOB = """
import logging, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from omegaconf import OmegaConf
from conftest import compose_config
import posttrain.prepare.warm_start as module
from posttrain.prepare.cache import code_version
from posttrain.prepare.warm_start import warm_start, warm_start_plan
from posttrain.train import run
train = module.train_warm_start
# the trainer starts 3 s late: however the jobs are scheduled after "go", the other one is
# then waiting on the lock, not finding the entry already there
module.train_warm_start = lambda *args: (time.sleep(3), train(*args))
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
cfg = compose_config({overrides!r}, Path({root!r}) / "run")
OmegaConf.resolve(cfg)  # as run() does
warm_start_plan(cfg), code_version()  # the slow imports before the start line
barrier = Path({root!r})
(barrier / f"ready-{{sys.argv[1]}}").touch()
while not (barrier / "go").exists():
    time.sleep(0.01)
print("got", warm_start(cfg, train=run), flush=True)
"""


def test_jobs_starting_one_uncached_warm_start_at_once_train_it_once(tmp_path):
    overrides = [*FAST_RUN, "algorithm=grpo", "algorithm.warm_start.steps=20", "algorithm.warm_start.until_accuracy=null",
                 "model.hidden_size=32", f"paths.cache_dir={tmp_path / 'cache'}"]
    script = WARM_START_JOB.format(tests=str(TESTS), overrides=overrides, root=str(tmp_path))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    jobs = [subprocess.Popen([sys.executable, "-c", script, str(i)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=env) for i in range(2)]
    deadline = time.monotonic() + 300
    while not all((tmp_path / f"ready-{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline and all(job.poll() is None for job in jobs), \
            [job.communicate()[0][-3000:] for job in jobs if job.poll() is not None]
        time.sleep(0.05)
    (tmp_path / "go").touch()
    outputs = [job.communicate(timeout=300)[0] for job in jobs]
    assert all(job.returncode == 0 for job in jobs), [o[-3000:] for o in outputs]
    both = "".join(outputs)
    assert both.count("Warm start: SFT") == 1, both[-4000:]  # one training, not two
    # the waiter names the holder's host when the holder has written it, "another job" when it has not yet
    assert "Warm start: waiting for " in both and "Warm start: trained by another job" in both
    got = {line for line in both.splitlines() if line.startswith("got ")}
    assert len(got) == 1  # the same cache entry for both
    # the entry alone: no scratch directory, no lock file left
    assert len(list((tmp_path / "cache" / "warm_start").iterdir())) == 1


HOLDER = """
import sys, time
from pathlib import Path
from posttrain.prepare.cache import cache_lock
with cache_lock(Path(sys.argv[1])):
    print("holding", flush=True)
    time.sleep(600)
"""


def test_a_killed_holder_does_not_block_the_others(tmp_path):
    target = tmp_path / "warm_start" / "key"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(target)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    acquired = threading.Event()

    def wait_for_the_lock():
        with cache_lock(target):
            acquired.set()

    waiter = threading.Thread(target=wait_for_the_lock, daemon=True)
    waiter.start()
    assert not acquired.wait(1.0)  # held: the waiter waits
    os.kill(holder.pid, signal.SIGKILL)  # a job killed mid-training (preempted, OOM, scancel)
    holder.wait()
    assert acquired.wait(10.0), "the lock of a dead holder was not released"


def plan(make_config, *overrides):
    cfg = make_config(*overrides)
    OmegaConf.resolve(cfg)  # as run() does
    return warm_start_plan(cfg)


def test_the_cache_key_changes_with_the_code_version(make_config, monkeypatch):
    key = plan(make_config, "algorithm=grpo")[1]
    assert plan(make_config, "algorithm=grpo")[1] == key  # same code, same key
    monkeypatch.setattr(warm_start_module, "code_version", lambda *entries: "posttrain 9.9 source 0123")
    assert plan(make_config, "algorithm=grpo")[1] != key


def test_the_runs_own_callbacks_and_panel_are_not_the_warm_starts(make_config, tmp_path):
    """A user's callbacks watch their run and the prompt panel compares runs: the warm start runs
    neither, and neither changes its key (a sweep over them shares one start)."""
    panel_file = tmp_path / "panel.jsonl"
    plain = plan(make_config, "algorithm=grpo")
    own = plan(make_config, "algorithm=grpo", "eval.panel.size=3", f"eval.panel.file={panel_file}",
               "callbacks.extra=[{_target_: lightning.pytorch.callbacks.Timer}]")
    assert own[1] == plain[1]
    assert own[0].callbacks.extra == [] and own[0].eval.panel.size == 0 and own[0].eval.panel.file is None


def test_a_sweeps_budget_in_rollout_batches_is_not_the_warm_starts(make_config):
    plain = plan(make_config, "algorithm=grpo")
    budgeted = plan(make_config, "algorithm=grpo", "+sweep=grpo_family")
    assert budgeted[1] == plain[1]  # one warm start for the grids and for single runs
    assert "limit_train_batches" not in budgeted[0].trainer and "max_epochs" not in budgeted[0].trainer

