"""Evaluation suites (`eval.suites`, algorithms/eval_suites.py): a suite's metrics against
hand-computed values on scripted responses, the ranks' shares adding up to one process's sums,
the start-up refusals, and two training steps of the embedded model with two suites, read back
from metrics.jsonl and reproduced by posttrain-eval."""

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import compose_config
from forked_cli import run_command
from posttrain.algorithms.base import Scored
from posttrain.algorithms.eval_suites import EvalSuite, suites_metrics, suites_sums
from posttrain.config.check import check_config
from posttrain.data.examples import Example
from posttrain.distributed import collectives
from posttrain.errors import ConfigError
from posttrain.rollout import SamplingParams


class LastNumberTask:
    """A task whose answer is the last number of a response."""

    def final_answer(self, text: str):
        numbers = re.findall(r"\d+", text)
        return numbers[-1] if numbers else None

    def is_correct(self, example, text: str) -> bool:
        return self.final_answer(text) == example.answer


class CharTokenizer:
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


# Three prompts, four scripted responses each (right answers 5, 3, 9).
EXAMPLES = [Example("2+3", "5", "5", source="x"), Example("1+2", "3", "3", source="x"),
            Example("4+5", "9", "9", source="y")]
RESPONSES = {"2+3": ["5", "5", "7", "none"],   # right, right, wrong, no answer
             "1+2": ["4", "4", "3", "3"],      # a 2-2 tie between a wrong and the right answer
             "4+5": ["1", "2", "6", "8"]}      # all wrong, all different


def scripted_generate_and_score(calls: list):
    """A stand-in for base.generate_and_score: row j of a prompt's `samples` rows answers its
    j-th scripted response; records the rows of each call."""

    def generate_and_score(module, batch, params, generator=None, source=None):
        calls.append(len(batch["examples"]))
        texts, seen = [], {}
        for example in batch["examples"]:
            j = seen.get(example.prompt, 0)
            seen[example.prompt] = j + 1
            texts.append(RESPONSES[example.prompt][j])
        correct = [float(source.is_correct(e, t)) for e, t in zip(batch["examples"], texts)]
        return Scored(texts, correct, [float(len(t)) for t in texts], [False] * len(texts))

    return generate_and_score


def suite(metrics) -> EvalSuite:
    return EvalSuite("scripted", LastNumberTask(), EXAMPLES, 4, SamplingParams(max_new_tokens=4), tuple(metrics),
                     ("x", "y"))


MODULE = SimpleNamespace(tokenizer=CharTokenizer(), device=torch.device("cpu"))
METRICS = ("accuracy", "pass@1", "pass@2", "pass@4", "maj@2", "maj@4", "mean@4", "response_len")


def test_suite_metrics_against_hand_computed_values():
    the_suite = suite(METRICS)
    calls = []
    sums = suites_sums(MODULE, [the_suite], scripted_generate_and_score(calls), seed=0, rows_per_call=12)
    metrics = suites_metrics([the_suite], sums)
    expected = {
        "accuracy": 4 / 12,                  # 2 + 2 + 0 right of 12 responses
        "pass@1": (2 / 4 + 2 / 4 + 0) / 3,    # c/n per prompt
        "pass@2": (5 / 6 + 5 / 6 + 0) / 3,    # 1 - C(2,2)/C(4,2) = 5/6 for c = 2 of n = 4
        "pass@4": (1 + 1 + 0) / 3,
        # maj@2 over the 6 pairs: prompt 1: {5,5} 1, {5,7} 1/2 (tie), {5,-} 1, {5,7} 1/2, {5,-} 1,
        # {7,-} 0 -> 4/6; prompt 2: {4,4} 0, four {4,3} ties 1/2, {3,3} 1 -> 3/6; prompt 3: 0
        "maj@2": (4 / 6 + 3 / 6 + 0) / 3,
        # maj@4: 5 wins 2-1 (right); 4 and 3 tie (1/2); four answers tie, none right (0)
        "maj@4": (1 + 1 / 2 + 0) / 3,
        "mean@4": (2 / 4 + 2 / 4 + 0) / 3,
        "response_len": (1 + 1 + 1 + 4 + 4 * 1 + 4 * 1) / 12,  # "none" is 4 characters
    }
    for name, value in expected.items():
        assert metrics[f"eval/scripted/{name}"] == pytest.approx(value, abs=1e-12), name
    # per source: x holds the first two prompts (4 of 8 right), y the third (0 of 4)
    assert metrics["eval/scripted/x/accuracy"] == pytest.approx(0.5)
    assert metrics["eval/scripted/y/accuracy"] == 0.0
    assert calls == [12]  # three whole prompts of 4 rows in one call of 12 rows


def test_a_suite_logs_only_its_metrics():
    sums = suites_sums(MODULE, [suite(("maj@4",))], scripted_generate_and_score([]), seed=0, rows_per_call=12)
    assert suites_metrics([suite(("maj@4",))], sums) == {"eval/scripted/maj@4": pytest.approx(0.5),
                                                         "eval/scripted/x/accuracy": 0.5,
                                                         "eval/scripted/y/accuracy": 0.0}


def test_two_ranks_make_the_same_calls_and_their_sums_add_up_to_one_process(monkeypatch):
    the_suite = suite(METRICS)
    whole = suites_sums(MODULE, [the_suite], scripted_generate_and_score([]), seed=0, rows_per_call=4)
    per_rank, calls = [], []
    for rank in (0, 1):
        monkeypatch.setattr(collectives, "rank_and_world", lambda rank=rank: (rank, 2))
        rank_calls = []
        per_rank.append(suites_sums(MODULE, [the_suite], scripted_generate_and_score(rank_calls), seed=0,
                                    rows_per_call=4))
        calls.append(rank_calls)
    # rank 0: prompts 0 and 2; rank 1: prompt 1 and a stand-in (prompt 0, counted nowhere);
    # one prompt of 4 rows per call: two calls each
    assert calls == [[4, 4], [4, 4]]
    assert torch.equal(per_rank[0] + per_rank[1], whole)
    assert suites_metrics([the_suite], per_rank[0] + per_rank[1]) == suites_metrics([the_suite], whole)


@pytest.mark.parametrize("suites, named", [
    ("{s: {sample: 4}}", "eval.suites.s: unknown key(s) ['sample']"),
    ("{s: {samples: 2, metrics: [pass@4]}}", "eval.suites.s.metrics asks for pass@4, but eval.suites.s.samples=2"),
    ("{s: {metrics: [best@2]}}", "eval.suites.s.metrics=['best@2'] is not valid"),
    ("{s: {data: no_such_task}}", "eval.suites.s.data='no_such_task': there is no data option 'no_such_task'"),
    ("{s: {data: {source: arithmetic, max_digit: 4}}}", "eval.suites.s.data.max_digit is not a key of data=arithmetic"),
    ("{s: {samples: 0}}", "eval.suites.s.samples=0 is not valid"),
    ("{s: {temperature: 0.7}}", "eval.suites.s.temperature=0.7 is read only with samples > 1"),
])
def test_a_bad_suite_is_refused_at_start_up_naming_its_key(suites, named):
    with pytest.raises(ConfigError) as refused:
        check_config(compose_config([f"eval.suites={suites}"]))
    assert named in str(refused.value)


def test_a_suite_needs_an_algorithm_that_generates():
    with pytest.raises(ConfigError, match=r"eval.suites=\['s'\]: algorithm=reward_model .* generates no responses"):
        check_config(compose_config(["algorithm=reward_model", "eval.suites={s: {samples: 1}}"]))


def test_the_default_and_a_valid_suite_pass():
    check_config(compose_config([]))
    check_config(compose_config(["eval.suites={s: {data: {source: arithmetic, max_digits: 4}, samples: 4, "
                                 "temperature: 0.7, metrics: [pass@4, maj@2]}}"]))


SUITES = ("eval.suites={same: {samples: 1}, sampled: {data: {source: arithmetic, min_digits: 2, max_digits: 2}, "
          "num_prompts: 6, samples: 4, temperature: 1.0, metrics: [accuracy, pass@1, pass@4, maj@4, mean@4, "
          "response_len]}}")


def test_two_training_steps_log_both_suites_and_posttrain_eval_reproduces_them(tmp_path):
    command = [sys.executable, "-m", "posttrain.train", "algorithm=sft", "trainer.max_steps=2",
               "trainer.val_check_interval=2", "eval.num_prompts=8", "eval.batch_size=8", "data.min_digits=1",
               "data.max_digits=1", SUITES, "logger=none", "callbacks.progress_bar=none", "num_threads=1",
               f"paths.log_dir={tmp_path / 'train'}"]
    ran = run_command(command, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    (run_dir,) = (tmp_path / "train").glob("sft/runs/*")
    evals = [row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "eval/accuracy" in row]
    assert [row["batch"] for row in evals] == [0, 2]  # before training and after step 2
    for row in evals:
        # `same` is the run's own held-out set, greedy: the held-out evaluation's numbers
        assert row["eval/same/accuracy"] == row["eval/accuracy"]
        assert row["eval/same/response_len"] == row["eval/response_len"]
        # sampled: pass@1 and mean@4 are both c/n per prompt, the accuracy its mean over all responses
        assert row["eval/sampled/pass@1"] == pytest.approx(row["eval/sampled/accuracy"], abs=1e-9)
        assert row["eval/sampled/mean@4"] == pytest.approx(row["eval/sampled/accuracy"], abs=1e-9)
        assert row["eval/sampled/pass@1"] <= row["eval/sampled/pass@4"] <= 1.0
        assert 0.0 <= row["eval/sampled/maj@4"] <= row["eval/sampled/pass@4"]
        assert 0 < row["eval/sampled/response_len"] <= 8  # data.max_response_tokens of 2-digit addition
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval/sampled/pass@4"] == evals[-1]["eval/sampled/pass@4"]
    assert summary["eval/same/accuracy_start"] == evals[0]["eval/same/accuracy"]

    ran = run_command([sys.executable, "-m", "posttrain.eval.evaluate", f"checkpoint={run_dir}", "pass_k=[]",
                       "num_threads=1", f"paths.log_dir={tmp_path / 'eval'}"], capture_output=True, text=True,
                      timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "evaluation suites" in ran.stdout + ran.stderr
    (results,) = (tmp_path / "eval").glob("eval/runs/*/eval.json")
    results = json.loads(results.read_text())
    assert results["suites"]["sampled"] == {"num_prompts": 6, "samples": 4, "temperature": 1.0,
                                            "metrics": ["accuracy", "pass@1", "pass@4", "maj@4", "mean@4",
                                                        "response_len"]}
    for key in ("eval/same/accuracy", "eval/sampled/pass@4", "eval/sampled/maj@4", "eval/sampled/response_len"):
        assert results[key] == pytest.approx(evals[-1][key], abs=1e-9), key  # the same seeded draws


def test_a_bad_suite_on_the_command_line_exits_1_before_any_run_directory(tmp_path):
    ran = run_command([sys.executable, "-m", "posttrain.train", "eval.suites={s: {samples: 2, metrics: [maj@3]}}",
                       f"paths.log_dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 1 and "eval.suites.s.metrics asks for maj@3" in ran.stderr
    assert "Traceback" not in ran.stderr and not list(Path(tmp_path).rglob("config.yaml"))


def test_held_out_accuracy_per_source_of_reasoning_gym_tasks(tmp_path):
    """data=reasoning_gym with two tasks: eval/<task>/accuracy beside eval/accuracy, whose mean
    over the tasks' prompts it is; the suite on the run's data has the same per-task keys."""
    pytest.importorskip("reasoning_gym", reason="data=reasoning_gym needs the reasoning-gym package")
    command = [sys.executable, "-m", "posttrain.train", "algorithm=sft", "data=reasoning_gym",
               "data.tasks=[{name: chain_sum, size: 40}, {name: basic_arithmetic, size: 20, config: {max_terms: 3}}]",
               "data.heldout_size=4", "data.chat=false", "data.shots=0", "data.max_response_tokens=8",
               "trainer.max_steps=1", "trainer.val_check_interval=1", "eval.num_prompts=8", "eval.batch_size=8",
               "eval.at_start=false", "eval.suites={same: {samples: 2}}", "logger=none",
               "callbacks.progress_bar=none", "num_threads=1", f"paths.log_dir={tmp_path}"]
    ran = run_command(command, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    (summary,) = tmp_path.rglob("summary.json")
    summary = json.loads(summary.read_text())
    tasks = ("basic_arithmetic", "chain_sum")
    for task in tasks:
        assert 0.0 <= summary[f"eval/{task}/accuracy"] <= 1.0
        assert 0.0 <= summary[f"eval/same/{task}/accuracy"] <= 1.0
    low, high = sorted(summary[f"eval/{task}/accuracy"] for task in tasks)
    assert low <= summary["eval/accuracy"] <= high  # a weighted mean of the two


def sweep_job(sweep: Path, number: int, algorithm: str, seed: int, summary: dict) -> None:
    path = sweep / f"{number}_{algorithm}"
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text(f"- algorithm={algorithm}\n- seed={seed}\n")
    (path / "summary.json").write_text(json.dumps({"eval/accuracy": 0.5, "eval/response_len": 4.0, **summary,
                                                   "choices": {"algorithm": algorithm}}))


def test_the_report_tables_and_judges_each_suite(tmp_path):
    from posttrain.eval.report.document import write_report

    # two arms, two seeds; suite `words` (accuracy, maj@4, length) and source `x` (accuracy)
    for number, (algorithm, seed, accuracy, majority, length) in enumerate(
            [("grpo", 0, 0.5, 0.6, 10.0), ("grpo", 1, 0.6, 0.7, 12.0), ("ppo", 0, 0.3, 0.6, 10.0),
             ("ppo", 1, 0.4, 0.7, 12.0)]):
        sweep_job(tmp_path, number, algorithm, seed,
                  {"eval/words/accuracy_start": 0.1, "eval/words/accuracy": accuracy, "eval/words/maj@4": majority,
                   "eval/words/response_len": length, "eval/x/accuracy": accuracy,
                   "eval/episode/turns": 2.0, "eval/reliability/bin00/accuracy": 0.0})
    report = write_report(tmp_path).read_text()
    suites = report.split("## Evaluation suites and sources")[1].split("##")[0]
    header = next(line for line in suites.splitlines() if line.startswith("| algorithm"))
    assert header == ("| algorithm | n | words/accuracy start | words/accuracy | words/maj@4 | words/response_len | "
                      "x/accuracy |")
    # grpo: accuracy 50, 60 -> 55.0 ± 7.1 (sample std 7.07); maj@4 65.0 ± 7.1; length 11.00 ± 1.41
    assert "| grpo | 2 | 10.0 ± 0.0 | 55.0 ± 7.1 | 65.0 ± 7.1 | 11.00 ± 1.41 | 55.0 ± 7.1 |" in suites
    assert "| ppo | 2 | 10.0 ± 0.0 | 35.0 ± 7.1 | 65.0 ± 7.1 | 11.00 ± 1.41 | 35.0 ± 7.1 |" in suites
    # the verdicts: a section per suite metric; ppo is 20 points below grpo on both seeds: worse
    words = report.split("### suite or source `words`: accuracy %: `eval/words/accuracy`, higher is better")[1]
    ppo_row = next(line for line in words.splitlines() if line.startswith("| 1 | algorithm=ppo"))
    assert "-20.0 [-20.0, -20.0]" in ppo_row and "**worse**" in ppo_row
    assert "### suite or source `words`: maj@4 %: `eval/words/maj@4`, higher is better" in report
    assert "### suite or source `words`: response_len (tokens): `eval/words/response_len`, lower is better" in report
    assert "### suite or source `x`: accuracy %" in report
    assert "episode" not in suites and "reliability" not in suites  # the held-out evaluation's own namespaces


def test_two_ddp_ranks_with_uneven_shares_give_the_one_process_numbers(tmp_path):
    """trainer=ddp, 2 ranks, suites of 5 and 3 prompts (shares of 3 and 2, padded with a stand-in):
    the job finishes (the ranks made the same generate calls), and the final model's greedy suite,
    evaluated again in one process by posttrain-eval, has the same accuracy and length."""
    import os

    from conftest import TORCHRUN

    overrides = ["trainer=ddp", "algorithm=sft", "trainer.max_steps=2", "trainer.val_check_interval=2",
                 "data.min_digits=1", "data.max_digits=1", "eval.num_prompts=5", "eval.batch_size=4",
                 "eval.at_start=false", "eval.suites={greedy: {num_prompts: 5}, sampled: {num_prompts: 3, samples: 2, "
                 "metrics: [pass@2, maj@2]}}", "logger=none", "callbacks.progress_bar=none", "num_threads=1",
                 f"hydra.run.dir={tmp_path}/run", f"paths.cache_dir={tmp_path}/cache"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    ran = run_command([*TORCHRUN, "-m", "posttrain.train", *overrides], capture_output=True, text=True, env=env,
                      timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert {"eval/sampled/pass@2", "eval/sampled/maj@2"} <= set(summary)
    assert summary["eval/greedy/accuracy"] == summary["eval/accuracy"]  # the same 5 prompts, greedy
    ran = run_command([sys.executable, "-m", "posttrain.eval.evaluate", f"checkpoint={tmp_path / 'run'}",
                       "pass_k=[]", "num_threads=1", f"paths.log_dir={tmp_path / 'eval'}"], capture_output=True,
                      text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    (results,) = (tmp_path / "eval").glob("eval/runs/*/eval.json")
    results = json.loads(results.read_text())
    for key in ("eval/greedy/accuracy", "eval/greedy/response_len"):
        assert results[key] == pytest.approx(summary[key], abs=1e-6), key


def test_the_panel_index_shows_each_runs_suites_at_the_batch_it_shows(tmp_path):
    from posttrain.eval.report.panel_pages import write_panel_pages

    line = {"prompt": "1+2", "reference": "3", "answer": "3", "response": "3", "reward": 1.0, "components": {},
            "correct": True, "length": 1, "truncated": False}
    for name, accuracy in (("a", 0.25), ("b", 0.5)):
        run_dir = tmp_path / name
        (run_dir / "panel").mkdir(parents=True)
        for batch in (0, 4):
            (run_dir / "panel" / f"batch{batch:06d}.jsonl").write_text(json.dumps({**line, "batch": batch}) + "\n")
        history = [{"step": 0, "batch": 0, "eval/accuracy": 0.0, "eval/words/accuracy": 0.0},
                   {"step": 4, "batch": 4, "eval/accuracy": accuracy, "eval/words/accuracy": accuracy,
                    "eval/words/response_len": 3.5, "eval/reliability/bin00/accuracy": 0.0}]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in history))
    index = write_panel_pages([tmp_path / "a", tmp_path / "b"], tmp_path / "pages").read_text()
    table = index.split("Evaluation suites and sources at batch 4")[1]
    assert "| metric | a | b |" in table
    assert "| `eval/words/accuracy` | 25.0 | 50.0 |" in table
    assert "| `eval/words/response_len` | 3.50 | 3.50 |" in table
    assert "reliability" not in table


def test_the_warm_start_evaluates_no_suite_and_its_cache_key_ignores_them(make_config):
    from omegaconf import OmegaConf

    from posttrain.prepare.warm_start import warm_start_plan

    def plan(*overrides):
        cfg = make_config("algorithm=grpo", *overrides)
        OmegaConf.resolve(cfg)
        return warm_start_plan(cfg)

    plain_cfg, plain_dir = plan()
    with_suites_cfg, with_suites_dir = plan("eval.suites={s: {samples: 4, metrics: [pass@4]}}")
    assert with_suites_dir == plain_dir
    assert plain_cfg.eval.suites is None and with_suites_cfg.eval.suites is None


def test_a_suite_may_not_take_a_name_the_held_out_evaluation_logs_under():
    with pytest.raises(ConfigError, match="the suite name 'reliability' is taken by the held-out evaluation's own"):
        check_config(compose_config(["eval.suites={reliability: {samples: 1}}"]))
    with pytest.raises(ConfigError, match="the suite name 'a/b' names its metrics"):
        check_config(compose_config(["eval.suites={a/b: {samples: 1}}"]))


class MixtureOfOne:
    """A mixture's interface (data/mixture.py): only the example's own source extracts answers."""

    def __init__(self):
        self.task = LastNumberTask()

    def source_of(self, example):
        return self.task

    def is_correct(self, example, text: str) -> bool:
        return self.task.is_correct(example, text)

    def final_answer(self, text: str):
        raise AssertionError("a mixture's final answer needs the example")


def test_a_mixture_votes_with_each_examples_own_source():
    the_suite = EvalSuite("mixed", MixtureOfOne(), EXAMPLES, 4, SamplingParams(max_new_tokens=4), ("maj@4",),
                          ("x", "y"))
    sums = suites_sums(MODULE, [the_suite], scripted_generate_and_score([]), seed=0, rows_per_call=12)
    assert suites_metrics([the_suite], sums)["eval/mixed/maj@4"] == pytest.approx((1 + 1 / 2 + 0) / 3)
