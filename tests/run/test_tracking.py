"""Tracking: the W&B run of a job (name, group, job type, tags, config, id), the table of
sample completions at each held-out eval, and held-out pass@k."""

import csv
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import posttrain.train
from posttrain.algorithms.base import PosttrainModule
from posttrain.errors import ConfigError
from posttrain.run.tracking import build_logger
from posttrain.train import run

from conftest import EASY_TASK, FAST_RUN
from test_logging import offline_run, wandb_records

UNLOGGED_FAST_RUN = tuple(o for o in FAST_RUN if not o.startswith("logger="))
SWEEP_TIME = "2026-11-24_01-02-03"


@pytest.fixture(autouse=True)
def eval_configured(monkeypatch):
    """train.build_module followed by the module's `configure_eval`, as train.run does it
    (idempotent: harmless where run already configures the module itself)."""
    build = posttrain.train.build_module

    def build_and_configure(cfg, policy, tokenizer, source):
        module = build(cfg, policy, tokenizer, source)
        module.configure_eval(cfg.eval, samples_dir=Path(cfg.paths.output_dir) / "samples", seed=cfg.seed)
        return module

    monkeypatch.setattr(posttrain.train, "build_module", build_and_configure)


@pytest.fixture
def wandb_init(monkeypatch):
    """Records what build_logger gives WandbLogger (and so wandb.init) instead of starting W&B."""
    import lightning.pytorch.loggers

    calls = []

    class RecordingLogger:
        def __init__(self, **kwargs):
            calls.append(kwargs)
            self._wandb_init = dict(kwargs)

    monkeypatch.setattr(lightning.pytorch.loggers, "WandbLogger", RecordingLogger)
    monkeypatch.setenv("WANDB_MODE", "offline")
    return calls


def sweep_job_config(make_config, tmp_path, swept: list[str], *overrides: str):
    """A job of a sweep started at SWEEP_TIME whose command line was `swept` (multirun.yaml)."""
    sweep_dir = tmp_path / "multiruns" / SWEEP_TIME
    sweep_dir.mkdir(parents=True)
    (sweep_dir / "multirun.yaml").write_text(json.dumps({"hydra": {"overrides": {"task": swept}}}))
    return make_config("logger=wandb", "hydra.mode=MULTIRUN", f"hydra.sweep.dir={sweep_dir}", *overrides,
                       output_dir=sweep_dir / "0_grpo")


def test_single_run_wandb_init(make_config, tmp_path, wandb_init):
    cfg = make_config("logger=wandb", "algorithm=grpo", "kl_estimator=k3", "seed=3", "logger.tags=[mine]")
    build_logger(cfg, tmp_path, "grpo-group_norm-k3-seed3")
    (init,) = wandb_init
    assert init["name"] == "grpo-group_norm-k3-seed3" and init["project"] == "posttrain"
    assert init["group"] == "grpo"  # the task name
    assert init["job_type"] == "grpo"
    assert {"algorithm:grpo", "kl_estimator:k3", "advantage:group_norm", "model:tiny", "mine"} <= set(init["tags"])
    assert not any(tag.startswith(("logger:", "paths:", "hydra")) for tag in init["tags"])
    assert init["config"]["seed"] == 3 and init["config"]["kl_estimator"]["name"] == "k3"  # resolved config
    assert re.fullmatch(r"[0-9a-f]{40}", init["config"]["git_commit"])  # the tests run from a checkout
    assert isinstance(init["config"]["git_dirty"], bool)
    assert init["mode"] == "offline" and init["save_dir"] == str(tmp_path)
    assert init["resume"] == "allow" and init["id"] == (tmp_path / "wandb_run_id.txt").read_text().strip()


def test_resumed_job_continues_its_run(make_config, tmp_path, wandb_init):
    cfg = make_config("logger=wandb")
    build_logger(cfg, tmp_path, "a")
    build_logger(cfg, tmp_path, "a")  # `posttrain resume=<run dir>`, or a requeued job: same run dir
    assert wandb_init[0]["id"] == wandb_init[1]["id"]
    assert wandb_init[1]["resume"] == "allow"


@pytest.mark.parametrize("swept, overrides, group", [
    (["algorithm=grpo", "seed=0,1,2"], [], f"grpo-{SWEEP_TIME}"),  # one task: its name and the sweep's time
    (["algorithm=grpo,dapo"], [], f"sweep-{SWEEP_TIME}"),  # the task varies: one group for the sweep still
    (["algorithm=grpo", "seed=0,1"], ["logger.group=kl_study"], f"kl_study-{SWEEP_TIME}"),  # a named study
])
def test_sweep_job_wandb_group(make_config, tmp_path, wandb_init, swept, overrides, group):
    cfg = sweep_job_config(make_config, tmp_path, swept, "algorithm=grpo", *overrides)
    output_dir = Path(cfg.paths.output_dir)
    build_logger(cfg, output_dir, "grpo-group_norm-seed0")
    # resumed (`posttrain resume=<run dir>` runs a single run into the job's run dir): same group and id
    resumed = make_config("logger=wandb", "algorithm=grpo", *overrides, output_dir=output_dir)
    build_logger(resumed, output_dir, "grpo-group_norm-seed0")
    first, again = wandb_init
    assert first["group"] == again["group"] == group
    assert first["id"] == again["id"]
    assert first["job_type"] == "grpo" and "algorithm:grpo" in first["tags"]


def short_sft(make_config, tmp_path, *overrides: str):
    """8 SFT steps evaluated at start, at step 4 and at step 8, on 8 held-out prompts."""
    return make_config(*UNLOGGED_FAST_RUN, *EASY_TASK, "trainer.max_steps=8", "trainer.val_check_interval=4",
                       "callbacks.checkpoint.every_n_train_steps=8", "algorithm.batch_size=8", "eval.num_prompts=8",
                       "eval.batch_size=8", "eval.log_samples=3", *overrides, output_dir=tmp_path)


def read_samples(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_csv_run_writes_samples_and_pass_at_k_at_each_eval(make_config, tmp_path):
    summary = run(short_sft(make_config, tmp_path, "logger=csv", "eval.pass_k=[1,4]", "eval.num_samples=4"))
    files = sorted(p.name for p in (tmp_path / "samples").iterdir())
    assert files == ["step000000.jsonl", "step000004.jsonl", "step000008.jsonl"]  # start, mid, end
    for name in files:
        rows = read_samples(tmp_path / "samples" / name)
        assert len(rows) == 3
        for row in rows:
            assert set(row) == {"prompt", "response", "reward", "correct"}
            assert isinstance(row["correct"], bool) and row["reward"] == float(row["correct"])  # SFT: correctness
            assert row["prompt"].strip() and isinstance(row["response"], str)
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        evals = [row for row in csv.DictReader(f) if row.get("eval/accuracy")]
    assert len(evals) == 3
    for row in evals:
        pass1, pass4 = float(row["eval/pass@1"]), float(row["eval/pass@4"])
        assert 0.0 <= pass1 <= pass4 <= 1.0
    assert summary["eval/pass@1"] <= summary["eval/pass@4"] <= 1.0
    assert "eval/pass@4_start" in summary


def test_pass_at_k_is_off_by_default(make_config, tmp_path):
    summary = run(short_sft(make_config, tmp_path, "logger=csv", "eval.log_samples=0", "eval.at_start=false"))
    assert "eval/accuracy" in summary
    assert not any(key.startswith("eval/pass@") for key in summary)
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        assert not any(name.startswith("eval/pass@") for name in csv.DictReader(f).fieldnames)
    assert not (tmp_path / "samples").exists()  # log_samples=0: no table


def test_wandb_run_has_samples_table_and_pass_at_k(make_config, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run(short_sft(make_config, tmp_path, "logger=wandb", "eval.pass_k=[2]", "eval.num_samples=2",
                  "eval.at_start=false"))
    found = offline_run(tmp_path)
    assert found["exit_code"] == 0
    (header,) = [r.run for r in wandb_records(found["dir"]) if r.WhichOneof("record_type") == "run"]
    assert header.run_group == "sft" and header.job_type == "sft" and "algorithm:sft" in header.tags
    config = {item.key: json.loads(item.value_json) for item in header.config.update}
    commit = config["git_commit"]["value"] if isinstance(config["git_commit"], dict) else config["git_commit"]
    assert re.fullmatch(r"[0-9a-f]{40}", commit)
    tables = [row for row in found["history"] if "eval/samples/_type" in row]  # a table's fields: nested keys
    evals = [row for row in found["history"] if "eval/accuracy" in row]
    assert len(tables) == len(evals) == 2  # one table at each eval, on the eval's own logged step
    assert [row["trainer/global_step"] for row in tables] == [row["trainer/global_step"] for row in evals]
    assert all(row["eval/samples/_type"] == "table-file" and row["eval/samples/nrows"] == 3 for row in tables)
    assert all("eval/pass@2" in row for row in evals)
    (table_file,) = found["dir"].glob(f"files/{tables[0]['eval/samples/path']}")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["prompt", "response", "reward", "correct"] and len(table["data"]) == 3
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["step000004.jsonl", "step000008.jsonl"]


def test_online_rl_samples_carry_the_training_reward():
    """The samples table of an online-RL module reports its reward function's score."""
    from posttrain.algorithms.base import Scored
    from posttrain.data.examples import Example

    seen = []

    def reward_fn(samples, source):
        seen.extend(samples)
        total = torch.tensor([0.25 * (i + 1) for i in range(len(samples))])
        return SimpleNamespace(total=total, components={"accuracy": total})

    module = SimpleNamespace(reward_fn=reward_fn, source=None)
    module.sample_rewards = lambda *args: PosttrainModule.sample_rewards(module, *args)
    module.reward_components = lambda *args: PosttrainModule.reward_components(module, *args)
    examples = [Example(prompt="1+1=", response="2", answer="2"), Example(prompt="2+2=", response="4", answer="4")]
    scored = Scored(texts=["2", "5", "x"], correct=[1.0, 0.0, 0.0], lengths=[2.0, 2.0, 2.0],
                    truncated=[False, True, False])
    rows = PosttrainModule.sample_rows(module, examples, scored)
    assert rows == [{"prompt": "1+1=", "response": "2", "reward": 0.25, "correct": True},
                    {"prompt": "2+2=", "response": "5", "reward": 0.5, "correct": False}]
    assert [(s.response, s.truncated, s.group) for s in seen] == [("2", False, 0), ("5", True, 1)]


def test_pass_k_above_num_samples_is_refused(make_config, tmp_path):
    with pytest.raises(ConfigError, match=r"eval.pass_k=\[1, 8\].*eval.num_samples=4"):
        run(short_sft(make_config, tmp_path, "eval.pass_k=[1,8]", "eval.num_samples=4"))
