"""posttrain-report's verdicts (each arm against a baseline arm, over seeds), its budget axes
(--x samples / tokens / seconds), its --compare wiring, and the budget counters an online run
logs (rollout/samples_seen, rollout/tokens_seen) across a resume."""

from __future__ import annotations

import json
import math
import statistics
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from conftest import rl_config

from posttrain.core.statistics import student_t_quantile
from posttrain.errors import DataError
from posttrain.eval.report.command import main
from posttrain.eval.report.curves import budget_axis, on_budget_axis, seed_band, summed_over_resumes
from posttrain.eval.report.document import write_report
from posttrain.run.history import read_history
from posttrain.train import run

T2 = student_t_quantile(0.975, 2)  # 4.303: 3 seeds, 2 degrees of freedom


def job(sweep: Path, number: int, algorithm: str, seed: int, accuracy: float, length: float,
        history: list[dict] | None = None) -> Path:
    """A finished job as a sweep writes it: summary.json, .hydra/overrides.yaml, metrics.jsonl."""
    path = sweep / f"{number}_{algorithm}"
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"algorithm={algorithm}", f"seed={seed}"]))
    summary = {"eval/accuracy_start": 0.25, "eval/accuracy": accuracy, "eval/response_len_start": 5.0,
               "eval/response_len": length, "global_step": 3, "train_seconds": 10.0,
               "choices": {"algorithm": algorithm}}
    (path / "summary.json").write_text(json.dumps(summary))
    lines = history if history is not None else budget_history(rows=4, tokens=[20, 20, 20], seconds=[1, 2, 3])
    (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def budget_history(rows: int, tokens: list[int], seconds: list[float], rewards: list[float] | None = None,
                   restart_after: int | None = None) -> list[dict]:
    """Training lines at batches 1..n with the budget counters: `rows` completions and
    tokens[i] response tokens per batch; perf/elapsed_s restarts at 0 after `restart_after`."""
    lines, samples, generated, offset = [], 0, 0, 0.0
    for batch, (count, second) in enumerate(zip(tokens, seconds), start=1):
        samples, generated = samples + rows, generated + count
        if restart_after is not None and batch == restart_after + 1:
            offset = seconds[restart_after - 1]
        lines.append({"step": batch, "batch": batch, "rollout/batch": float(batch),
                      "rollout/reward_mean": (rewards or [0.1 * batch] * len(tokens))[batch - 1],
                      "rollout/samples_seen": float(samples), "rollout/tokens_seen": float(generated),
                      "perf/elapsed_s": second - offset})
    return lines


def two_arm_sweep(root: Path, grpo: list[float], dapo: list[float], dapo_seeds=(0, 1, 2)) -> Path:
    """grpo with seeds 0, 1, 2 and dapo with `dapo_seeds`; accuracies as given, dapo shorter."""
    for seed, accuracy in enumerate(grpo):
        job(root, seed, "grpo", seed, accuracy, length=5.0 + 0.1 * seed)
    for i, (seed, accuracy) in enumerate(zip(dapo_seeds, dapo)):
        job(root, 3 + i, "dapo", seed, accuracy, length=4.0 + 0.1 * i)
    return root


def verdict_rows(text: str, metric: str) -> list[str]:
    """The table rows of one metric's verdict section (after the change-from-the-start tables)."""
    section = text.split("## Verdicts", 1)[1].split(f"`{metric}`", 1)[1].split("###", 1)[0].split("## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| #")]


GRPO = [0.50, 0.55, 0.60]
DAPO = [0.60, 0.66, 0.70]


def test_the_verdict_table_by_hand(tmp_path):
    text = write_report(two_arm_sweep(tmp_path / "sweep", GRPO, DAPO)).read_text()
    assert "## Verdicts against arm 0: algorithm=grpo" in text
    # grpo: 55.0 ± T2 * 5 / sqrt(3) = ± 12.42; dapo: mean 65.33, s = sqrt(25.33) = 5.033 -> ± 12.50
    # paired differences 10, 11, 10 (points): mean 10.33, s = 0.577 -> ± T2 * 0.577 / sqrt(3) = ± 1.434
    grpo_half, dapo_half = T2 * 5 / math.sqrt(3), T2 * math.sqrt(76 / 3) / math.sqrt(3)
    diff_half = T2 * math.sqrt(1 / 3) / math.sqrt(3)
    grpo_row, dapo_row = verdict_rows(text, "eval/accuracy")
    assert grpo_row == (f"| 0 | algorithm=grpo | 3 | 55.0 [{55 - grpo_half:.1f}, {55 + grpo_half:.1f}] "
                        "| (baseline) |  |  |")
    assert dapo_row == (f"| 1 | algorithm=dapo | 3 | 65.3 [{196 / 3 - dapo_half:.1f}, {196 / 3 + dapo_half:.1f}] "
                        f"| +10.3 [+{31 / 3 - diff_half:.1f}, +{31 / 3 + diff_half:.1f}] | paired, 3 seeds "
                        "| **better** |")
    # the noise floor: the baseline's sample std (5 points) and its mean's half-width
    assert f"sample std of 5.0 over 3 seeds; its mean is known to ± {grpo_half:.1f} (95%)" in text
    # response length: lower is better, and dapo's is 1.0 shorter on every seed (a point interval)
    assert "`eval/response_len`, lower is better" in text
    length_row = verdict_rows(text, "eval/response_len")[1]
    assert length_row.endswith("| -1.00 [-1.00, -1.00] | paired, 3 seeds | **better** |")


def test_the_verdict_flips_to_within_noise_for_identical_arms(tmp_path):
    text = write_report(two_arm_sweep(tmp_path / "sweep", GRPO, GRPO)).read_text()
    assert verdict_rows(text, "eval/accuracy")[1].endswith("| +0.0 [+0.0, +0.0] | paired, 3 seeds | within noise |")
    # the same arms a little apart, by less than the seeds' shared noise: still within noise
    text = write_report(two_arm_sweep(tmp_path / "near", GRPO, [0.52, 0.54, 0.61])).read_text()
    assert verdict_rows(text, "eval/accuracy")[1].endswith("| paired, 3 seeds | within noise |")


@pytest.mark.parametrize("baseline", ["algorithm=dapo", "dapo", "1"])
def test_the_baseline_can_be_any_arm(tmp_path, baseline):
    text = write_report(two_arm_sweep(tmp_path / "sweep", GRPO, DAPO), baseline=baseline).read_text()
    assert "## Verdicts against arm 1: algorithm=dapo" in text
    grpo_row, dapo_row = verdict_rows(text, "eval/accuracy")
    assert grpo_row.startswith("| 0 | algorithm=grpo |") and grpo_row.endswith("| paired, 3 seeds | **worse** |")
    assert "-10.3 [" in grpo_row and "(baseline)" in dapo_row


def test_an_unknown_baseline_names_the_arms(tmp_path, capsys):
    sweep = two_arm_sweep(tmp_path / "sweep", GRPO, DAPO)
    with pytest.raises(SystemExit) as exit_info:
        main([str(sweep), "--baseline", "ppo"])
    assert exit_info.value.code == 1
    assert "--baseline ppo matches no arm; the arms are 0: algorithm=grpo; 1: algorithm=dapo" in capsys.readouterr().err


def test_arms_of_other_seeds_are_compared_unpaired(tmp_path):
    # dapo on seeds 3, 4, 5: Welch, df = (25/3 + 76/9)^2 / ((25/3)^2 / 2 + (76/9)^2 / 2) = 4.0
    text = write_report(two_arm_sweep(tmp_path / "sweep", GRPO, DAPO, dapo_seeds=(3, 4, 5))).read_text()
    row = verdict_rows(text, "eval/accuracy")[1]
    df = (25 / 3 + 76 / 9) ** 2 / ((25 / 3) ** 2 / 2 + (76 / 9) ** 2 / 2)
    half = student_t_quantile(0.975, df) * math.sqrt(25 / 3 + 76 / 9)
    # the same accuracies as when paired, but the seeds' own spread stays in the difference: not told from noise
    assert row.endswith(f"| +10.3 [{31 / 3 - half:+.1f}, {31 / 3 + half:+.1f}] | Welch, df {df:.1f} | within noise |")
    assert 31 / 3 - half < 0


def test_one_seed_per_arm_has_no_interval(tmp_path):
    root = tmp_path / "sweep"
    job(root, 0, "grpo", 0, 0.5, 5.0)
    job(root, 1, "dapo", 0, 0.9, 4.0)
    text = write_report(root).read_text()
    assert "Noise floor: the baseline has 1 seed" in text
    assert verdict_rows(text, "eval/accuracy")[1] == (
        "| 1 | algorithm=dapo | 1 | 90.0 (1 seed: no interval) | +40.0 (1 seed: no interval) "
        "| needs 2 seeds per arm | within noise |")


# --- budget axes ------------------------------------------------------------------------------


def test_elapsed_seconds_continue_across_a_resume():
    # batches 1-2 ran, the job stopped, batches 3-4 ran after the resume with the clock at 0
    assert summed_over_resumes({1: 1.0, 2: 2.5, 3: 0.5, 4: 1.5}) == {1: 1.0, 2: 2.5, 3: 3.0, 4: 4.0}
    assert summed_over_resumes({1: 1.0, 2: 2.0}) == {1: 1.0, 2: 2.0}


def test_budget_axes_move_each_point_to_its_batchs_budget():
    history = read_lines(budget_history(rows=8, tokens=[30, 10, 20], seconds=[1.0, 2.0, 3.5], restart_after=2))
    history["eval/accuracy"] = {0: 0.2, 3: 0.4}
    assert budget_axis(history, "samples") == {0: 0.0, 1: 8.0, 2: 16.0, 3: 24.0}
    assert budget_axis(history, "tokens") == {0: 0.0, 1: 30.0, 2: 40.0, 3: 60.0}
    assert budget_axis(history, "seconds") == {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.5}
    moved = on_budget_axis(history, budget_axis(history, "tokens"))
    assert moved["eval/accuracy"] == {0.0: 0.2, 60.0: 0.4}
    assert moved["rollout/reward_mean"] == pytest.approx({30.0: 0.1, 40.0: 0.2, 60.0: 0.3})
    assert budget_axis({"rollout/reward_mean": {1: 0.1}}, "samples") is None


def read_lines(lines: list[dict]) -> dict[str, dict[int, float]]:
    return {name: {line["batch"]: line[name] for line in lines if name in line}
            for name in lines[0] if name not in ("step", "batch")}


def test_seeds_that_spend_a_budget_unevenly_are_interpolated_onto_common_x():
    # tokens: seed a at 0, 100, 210; seed b at 0, 110, 200 -> common x 0, 100, 110, 200 (up to b's end)
    a, b = {0: 0.0, 100: 1.0, 210: 2.1}, {0: 0.0, 110: 2.2, 200: 4.0}
    xs, mean, low, high = seed_band([a, b], interpolate=True)
    assert xs == [0, 100, 110, 200]
    # a at 110: 1.0 + 1.1 * 10/110 = 1.1; a at 200: 1.0 + 1.1 * 100/110 = 2.0; b at 100: 2.2 * 100/110 = 2.0
    assert mean == pytest.approx([0.0, 1.5, (1.1 + 2.2) / 2, 3.0])
    assert low == pytest.approx([0.0, 1.0, 1.1, 2.0]) and high == pytest.approx([0.0, 2.0, 2.2, 4.0])
    # on batches nothing is interpolated: each x averages the seeds that logged it
    assert seed_band([a, b])[0] == [0, 100, 110, 200, 210]


def test_x_axis_option_draws_against_the_budget_and_names_it(tmp_path):
    sweep = two_arm_sweep(tmp_path / "sweep", GRPO, DAPO)
    main([str(sweep), "--x", "tokens", "--out", str(tmp_path / "tokens")])
    text = (tmp_path / "tokens" / "report.md").read_text()
    assert "x: generated response tokens (all ranks) (`rollout/tokens_seen`" in text
    assert (tmp_path / "tokens" / "reward.png").stat().st_size > 1000


def test_an_axis_no_run_logged_is_one_error(tmp_path, capsys):
    root = tmp_path / "sweep"
    job(root, 0, "grpo", 0, 0.5, 5.0, history=[{"step": 1, "batch": 1, "rollout/reward_mean": 0.1}])
    with pytest.raises(SystemExit):
        main([str(root), "--x", "samples"])
    assert "--x samples: no run logged rollout/samples_seen" in capsys.readouterr().err


# --- the command line -------------------------------------------------------------------------


def test_compare_calls_the_panel_pages_and_needs_no_root(tmp_path, monkeypatch, capsys):
    calls = []

    def write_panel_pages(run_dirs, out_dir, at_batches):
        calls.append((run_dirs, out_dir, at_batches))
        return out_dir / "index.html"

    monkeypatch.setitem(sys.modules, "posttrain.eval.report.panel_pages",
                        types.SimpleNamespace(write_panel_pages=write_panel_pages))
    runs = [job(tmp_path / "sweep", i, name, 0, 0.5, 5.0) for i, name in enumerate(("grpo", "dapo"))]
    main(["--compare", *map(str, runs), "--at", "10", "20"])
    assert calls == [(runs, (tmp_path / "sweep" / "compare").resolve(), [10, 20])]
    main(["--compare", str(runs[0]), "--out", str(tmp_path / "pages")])
    assert calls[-1] == ([runs[0]], tmp_path / "pages", None)
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [([], "give a sweep directory (root) or --compare"),
                                           (["--at", "5"], "--at picks the batches of --compare's pages"),
                                           (["--compare", "unreadable"], "unreadable: no panel files")])
def test_command_line_mistakes_are_one_line(argv, message, capsys, monkeypatch):
    def write_panel_pages(run_dirs, out_dir, at_batches):
        raise DataError(f"{run_dirs[0]}: no panel files")

    monkeypatch.setitem(sys.modules, "posttrain.eval.report.panel_pages",
                        types.SimpleNamespace(write_panel_pages=write_panel_pages))
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 1 and message in capsys.readouterr().err


# --- the counters, from a real run -------------------------------------------------------------


def test_an_online_run_counts_samples_and_tokens_across_a_resume(make_config, sft_start, tmp_path):
    """4 prompts x 4 samples a batch: 16 completions, and tokens the sum of the batch's response
    lengths; a run stopped after batch 2 and resumed in its own directory continues both counts,
    and its clock (perf/elapsed_s)."""
    common = ("algorithm=grpo", "trainer.max_steps=4", "callbacks.checkpoint.every_n_train_steps=2",
              "trainer.val_check_interval=100")
    run(rl_config(make_config, sft_start, *common, "callbacks.stop_at_step=2", output_dir=tmp_path / "job"))
    run(rl_config(make_config, sft_start, *common, f"ckpt_path={tmp_path}/job/checkpoints/last.ckpt",
                  output_dir=tmp_path / "job"))
    history = read_history(tmp_path / "job" / "metrics.jsonl")
    assert history["rollout/samples_seen"] == {1: 16.0, 2: 32.0, 3: 48.0, 4: 64.0}
    tokens, lengths = history["rollout/tokens_seen"], history["rollout/response_len_mean"]
    previous = 0.0
    for batch in (1, 2, 3, 4):
        assert tokens[batch] - previous == pytest.approx(16 * lengths[batch]), batch
        previous = tokens[batch]
    # the clock went on from the checkpoint's (taken after batch 2 was logged), not from 0
    stopped = torch.load(tmp_path / "job" / "checkpoints" / "step000002.ckpt", weights_only=False)
    elapsed = history["perf/elapsed_s"]
    assert elapsed[2] <= stopped["elapsed_s"] <= elapsed[3] < elapsed[4]
    assert budget_axis(history, "seconds") == {0: 0.0, **elapsed}


def test_dynamic_sampling_counts_the_rounds_it_dropped(make_config, sft_start, tmp_path):
    """DAPO samples extra rounds of prompts_per_step prompts until its batch is full: the budget
    counters count every completion and token it generated, kept or dropped."""
    run(rl_config(make_config, sft_start, "algorithm=dapo", "data_curriculum.max_extra_rounds=6", "trainer.max_steps=3",
                  output_dir=tmp_path / "dapo"))
    history = read_history(tmp_path / "dapo" / "metrics.jsonl")
    rounds, samples = history["curriculum/extra_rounds"], history["rollout/samples_seen"]
    assert sum(rounds.values()) > 0  # the test needs a dropped round to count
    previous = 0.0
    for batch in sorted(samples):
        assert samples[batch] - previous == 4 * 4 * (1 + rounds[batch]), batch  # 4 prompts x 4 samples a round
        previous = samples[batch]
    assert history["rollout/tokens_seen"][max(samples)] > 16 * 3 * min(history["rollout/response_len_mean"].values())


def test_simultaneous_intervals_widen_with_the_number_of_arms(tmp_path):
    """Three arms: judged one by one at 95%, dapo's paired differences 4, 5, 7 points (mean 5.33,
    s 1.53, t = 6.05 on 2 df) beat the baseline (t_.975 = 4.30); with --simultaneous each of the 2
    intervals is at 97.5% (t = 6.21) and the same difference is within noise."""
    sweep = two_arm_sweep(tmp_path / "sweep", GRPO, [0.54, 0.60, 0.67])
    for seed, accuracy in enumerate(GRPO):
        job(sweep, 6 + seed, "gspo", seed, accuracy, length=5.0)
    one_by_one = write_report(sweep, out_dir=tmp_path / "a").read_text()
    assert verdict_rows(one_by_one, "eval/accuracy")[1].endswith("| **better** |")
    assert "about 2 x 5% would still get a verdict; `--simultaneous`" in one_by_one
    together = write_report(sweep, out_dir=tmp_path / "b", simultaneous=True).read_text()
    assert "difference to baseline [97.5% CI]" in together
    dapo_row = verdict_rows(together, "eval/accuracy")[1]
    half = student_t_quantile(1 - 0.025 / 2, 2) * statistics.stdev([4, 5, 7]) / math.sqrt(3)
    assert f"| +5.3 [{16 / 3 - half:+.1f}, {16 / 3 + half:+.1f}] | paired, 3 seeds | within noise |" in dapo_row
    assert 16 / 3 - half < 0  # the interval now holds 0
