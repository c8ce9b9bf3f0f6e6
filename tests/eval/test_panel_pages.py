"""The prompt panel: the same prompts in every run (whatever its seed, rank count or eval size),
answered at each evaluation into <run>/panel/batch<N>.jsonl without changing any metric, and
read back side by side by `write_panel_pages` (posttrain-report --compare)."""

import json
import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from posttrain.data.panel import panel_examples
from posttrain.data.sources import build_source
from posttrain.errors import DataError
from posttrain.eval.report.panel_pages import write_panel_pages
from posttrain.train import run

from conftest import EASY_TASK, FAST_RUN, RANKS_START_METHOD, compose_config, free_port

PANEL = ("eval.panel.size=3", "eval.num_prompts=4", "eval.batch_size=4")
# GRPO from the random tiny model (no warm start): 2 rollout batches, evaluated at 0 and 2
GRPO = ("algorithm=grpo", "algorithm.warm_start.steps=0", "algorithm.prompts_per_step=2", "algorithm.group_size=2",
        "trainer.max_steps=2", "trainer.val_check_interval=2", "callbacks.checkpoint.every_n_train_steps=2")
# SFT: 4 batches, evaluated at 0 and 4
SFT = ("algorithm=sft", "algorithm.batch_size=8", "trainer.max_steps=4", "trainer.val_check_interval=4",
       "callbacks.checkpoint.every_n_train_steps=4")
# A 2-process job running longer than this is hung (alone it takes about 20 s on 2 busy cores).
JOB_TIMEOUT_S = 150


def run_config(out: Path, *overrides: str):
    return compose_config([*FAST_RUN, *EASY_TASK, *PANEL, "num_threads=1", f"paths.cache_dir={out.parent}/cache",
                           *overrides], out)


def train(out: Path, *overrides: str) -> Path:
    run(run_config(out, *overrides))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A short GRPO and a short SFT run with the default panel seed, in one sweep-like folder."""
    root = tmp_path_factory.mktemp("panel_runs")
    return {"grpo": train(root / "0_grpo", *GRPO), "sft": train(root / "1_sft", *SFT)}


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def panel_prompts(*overrides: str, size: int = 5, seed: int = 0) -> list[str]:
    cfg = compose_config(list(overrides))
    OmegaConf.resolve(cfg)
    return [e.prompt for e in panel_examples(build_source(cfg.data), cfg.eval.split, size, seed)]


def test_the_panel_is_the_same_whatever_the_run_seed_or_eval_size():
    panel = panel_prompts("seed=0", "eval.num_prompts=64")
    assert panel_prompts("seed=1", "eval.num_prompts=4") == panel
    assert len(set(panel)) == 5
    # ... while the held-out eval set follows the run's seed (arithmetic's data.seed: ${seed})
    first_eval_prompt = [build_source(compose_config([f"seed={s}"]).data).example("validation", 0).prompt
                         for s in (0, 1)]
    assert first_eval_prompt[0] != first_eval_prompt[1]
    assert panel_prompts(seed=1) != panel
    assert panel_prompts("data.max_digits=4") != panel  # another data config: another panel


def test_a_finite_split_gives_at_most_its_examples(tmp_path):
    rows = [{"prompt": f"{a}+1=", "response": str(a + 1), "answer": str(a + 1)} for a in range(10, 13)]
    for split in ("train", "validation"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = build_source(compose_config(["data=jsonl", f"data.files.train={tmp_path}/train.jsonl",
                                          f"data.files.validation={tmp_path}/validation.jsonl"]).data)
    drawn = panel_examples(source, "validation", 16, 0)
    assert sorted(e.prompt for e in drawn) == sorted(r["prompt"] for r in rows)


def test_a_panel_file_is_read_in_order_and_a_bad_line_names_file_and_line(tmp_path):
    source = build_source(compose_config([]).data)
    good = [{"prompt": "12+34=", "response": "46"}, {"prompt": "50+50=", "response": "100", "answer": "100"}]
    path = tmp_path / "panel.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in good))
    examples = panel_examples(source, "validation", 0, 0, file=str(path))
    assert [(e.prompt, e.response, e.answer) for e in examples] == [("12+34=", "46", None), ("50+50=", "100", "100")]
    path.write_text(json.dumps(good[0]) + "\n" + '{"prompt": "1+1="\n')
    with pytest.raises(DataError, match=f"{path}:2 .*eval.panel.file"):
        panel_examples(source, "validation", 0, 0, file=str(path))
    path.write_text(json.dumps(good[0]) + "\n" + json.dumps({"prompt": "1+1="}) + "\n")
    with pytest.raises(DataError, match=f"{path}:2 .*'response'"):
        panel_examples(source, "validation", 0, 0, file=str(path))


def test_runs_write_their_panel_with_reward_components_at_each_eval(runs):
    for name, batches in (("grpo", [0, 2]), ("sft", [0, 4])):
        files = sorted((runs[name] / "panel").glob("batch*.jsonl"))
        assert [f.name for f in files] == [f"batch{b:06d}.jsonl" for b in batches]
        for path, batch in zip(files, batches):
            lines = read_lines(path)
            assert [line["prompt"] for line in lines] == panel_prompts(*EASY_TASK, size=3)
            for line in lines:
                assert line["batch"] == batch and set(line["components"]) == {"accuracy"}
                # the default reward (and SFT's stand-in) is the verifier: reward = accuracy = right
                assert line["reward"] == line["components"]["accuracy"] == float(line["correct"])


def test_the_panel_changes_no_metric_of_the_run(runs, tmp_path):
    without = train(tmp_path / "no_panel", *SFT, "eval.panel.size=0")
    assert not (without / "panel").exists()

    def metrics(run_dir):
        return [{k: v for k, v in line.items() if not k.startswith("perf/")} for line in
                read_lines(run_dir / "metrics.jsonl")]

    assert metrics(without) == metrics(runs["sft"])


def rank_worker(rank: int, port: int, cfg_dicts: list[dict]) -> None:
    """Rank `rank` of a torchrun-like 2-process job (LOCAL_RANK set: Lightning does not spawn)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
                      NODE_RANK="0", WORLD_SIZE="2")
    try:
        run(OmegaConf.create(cfg_dicts[rank]), announce=False)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_two_fsdp_ranks_answer_the_one_process_panel_and_rank_0_writes_it(runs, tmp_path):
    # under FSDP every generate call is a collective: a rank that skipped the panel would hang the job
    out = [tmp_path / f"rank{rank}" for rank in range(2)]
    cfgs = [run_config(rank_dir, *SFT, "trainer=fsdp") for rank_dir in out]
    for cfg in cfgs:
        OmegaConf.resolve(cfg)
    job = mp.start_processes(rank_worker, args=(free_port(), [OmegaConf.to_container(cfg) for cfg in cfgs]), nprocs=2,
                             join=False, start_method=RANKS_START_METHOD)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not job.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in job.processes:
                process.kill()
            pytest.fail(f"the 2-process job hung (no end after {JOB_TIMEOUT_S} s): do the ranks generate alike?")
    assert sorted(p.name for p in (out[0] / "panel").iterdir()) == ["batch000000.jsonl", "batch000004.jsonl"]
    assert not (out[1] / "panel").exists()
    # before training the weights are the one-process run's: the same prompts, the same answers
    assert read_lines(out[0] / "panel" / "batch000000.jsonl") == read_lines(runs["sft"] / "panel" / "batch000000.jsonl")


def test_the_prompt_page_shows_both_runs_answers_side_by_side(runs, tmp_path):
    index = write_panel_pages([runs["grpo"], runs["sft"]], tmp_path / "pages", None)
    assert index == tmp_path / "pages" / "index.md"
    page = (tmp_path / "pages" / "prompt001.md").read_text()
    first = {name: read_lines(runs[name] / "panel" / f"batch{last:06d}.jsonl")[0]
             for name, last in (("grpo", 2), ("sft", 4))}
    assert first["grpo"]["prompt"] == first["sft"]["prompt"] and first["grpo"]["prompt"] in page
    # default batches: the first and the last any run evaluated at (4); GRPO's nearest to 4 is 2
    assert "## Batch 0" in page and "## Batch 4" in page
    final = page.split("## Batch 4")[1]
    header, _, response_row = final.strip().splitlines()[:3]
    assert header == "|  | 0_grpo | 1_sft |"
    cells = [cell.strip() for cell in response_row.split("|")[1:-1]]
    assert cells[0] == "response"
    for cell, name in zip(cells[1:], ("grpo", "sft")):
        response = first[name]["response"]
        assert cell.startswith(f"<code>{response}</code>" if response else "<em>(empty)</em>")
    assert "| evaluated at batch | 2 | 4 |" in final
    assert "(prompt003.md)" in index.read_text() and not (tmp_path / "pages" / "prompt004.md").exists()


def test_chosen_batches_take_each_runs_nearest_and_a_sweep_dir_stands_for_its_runs(runs, tmp_path):
    sweep = runs["grpo"].parent  # holds both runs, and the cache (whose warm-start runs are not runs of it)
    write_panel_pages([sweep], tmp_path / "pages", [3, 2, 3])
    page = (tmp_path / "pages" / "prompt002.md").read_text()
    assert page.count("## Batch") == 2 and "## Batch 0" not in page
    at_2, at_3 = page.split("## Batch 3")  # in batch order
    assert "## Batch 2" in at_2
    assert "| evaluated at batch | 2 | 0 |" in at_2  # SFT has 0 and 4: a tie goes to the earlier
    assert "| evaluated at batch | 2 | 4 |" in at_3
    index = (tmp_path / "pages" / "index.md").read_text()
    assert index.count("`" + str(runs["grpo"])) == 1 and index.count("`" + str(runs["sft"])) == 1


def test_a_directory_without_panel_files_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match=f"{tmp_path}: no run with panel files"):
        write_panel_pages([tmp_path], tmp_path / "pages", None)


def fake_run(run_dir: Path, overrides: list[str], answers: dict[int, list[tuple[str, str, bool]]]) -> Path:
    """A run directory as a run leaves it: its overrides, and per batch (prompt, response, right) lines."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (run_dir / "panel").mkdir()
    for batch, rows in answers.items():
        lines = [{"batch": batch, "prompt": prompt, "reference": "ref", "answer": None, "response": response,
                  "reward": float(right), "components": {"accuracy": float(right)}, "correct": right, "length": 1,
                  "truncated": False} for prompt, response, right in rows]
        (run_dir / "panel" / f"batch{batch:06d}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run_dir


def test_runs_are_named_by_the_overrides_they_differ_in_and_responses_keep_their_shape(tmp_path):
    sweep = tmp_path / "sweep"
    fake_run(sweep / "0_grpo", ["algorithm=grpo", "algorithm.group_size=8", "seed=0"],
             {0: [("1+1=", "<think>2</think>", True)]})
    fake_run(sweep / "1_sft", ["algorithm=sft", "seed=0"], {0: [("1+1=", "two\nor | three", False)]})
    # a warm start trained for the sweep is not one of its runs
    fake_run(sweep / "cache" / "warm_start" / "abc", ["algorithm=sft"], {0: [("1+1=", "2", True)]})
    write_panel_pages([sweep], tmp_path / "pages", None)
    page = (tmp_path / "pages" / "prompt001.md").read_text()
    assert "|  | algorithm=grpo | algorithm=sft |" in page  # seed is the same; group_size belongs to grpo
    assert "| response | <code>&lt;think&gt;2&lt;/think&gt;</code> | <code>two<br>or &#124; three</code> |" in page
    assert "| right | ✓ | ✗ |" in page
    assert "abc" not in (tmp_path / "pages" / "index.md").read_text()


def test_a_run_missing_a_prompt_shows_a_dash_and_a_broken_panel_file_names_its_line(tmp_path):
    first = fake_run(tmp_path / "a", [], {0: [("1+1=", "2", True), ("2+2=", "4", True)]})
    second = fake_run(tmp_path / "b", [], {0: [("1+1=", "3", False)]})
    write_panel_pages([first, second], tmp_path / "pages", [0])
    page = (tmp_path / "pages" / "prompt002.md").read_text()
    assert "| response | <code>4</code> | — (not on this run's panel) |" in page
    write_panel_pages([second], tmp_path / "pages", [0])  # one prompt now: the old second page goes
    assert sorted(p.name for p in (tmp_path / "pages").iterdir()) == ["index.md", "prompt001.md"]
    broken = second / "panel" / "batch000000.jsonl"
    broken.write_text(broken.read_text() + '{"prompt": \n')
    with pytest.raises(DataError, match=f"{broken}:2 is not valid JSON"):
        write_panel_pages([first, second], tmp_path / "pages", [0])
