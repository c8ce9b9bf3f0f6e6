"""Held-out calibration (PosttrainModule.log_calibration): `eval/ece`, `eval/confidence` and the
reliability bins of a short run, and their section in `posttrain-report`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from posttrain.algorithms.base import generate_and_score
from posttrain.data.datamodule import collate_prompts
from posttrain.eval.report.calibration import reliability_points
from posttrain.eval.report.document import write_report
from posttrain.rollout import SamplingParams
from posttrain.train import run

from conftest import EASY_TASK, FAST_RUN, module_from_config

BINS = 10


def bins_of(summary: dict, suffix: str = "") -> list[tuple[float, float, float]]:
    """(share, confidence, accuracy) of each reliability bin in a summary."""
    return [tuple(summary[f"eval/reliability/bin{b:02d}/{name}{suffix}"] for name in ("share", "confidence", "accuracy"))
            for b in range(BINS)]


def test_a_short_run_reports_its_calibration_before_and_after(make_config, tmp_path):
    summary = run(make_config(*FAST_RUN, *EASY_TASK, "trainer.max_steps=4", "trainer.val_check_interval=4",
                              "algorithm.batch_size=8", "eval.num_prompts=16", "eval.batch_size=16"))
    for suffix in ("_start", ""):
        ece, confidence = summary[f"eval/ece{suffix}"], summary[f"eval/confidence{suffix}"]
        assert 0.0 <= ece <= 1.0 and 0.0 < confidence <= 1.0
        bins = bins_of(summary, suffix)
        assert sum(share for share, _, _ in bins) == pytest.approx(1.0)
        # the ECE is the share-weighted gap of the bins; their shares weigh the mean confidence
        assert ece == pytest.approx(sum(share * abs(acc - conf) for share, conf, acc in bins), abs=1e-6)
        assert confidence == pytest.approx(sum(share * conf for share, conf, _ in bins), abs=1e-6)
        assert summary[f"eval/accuracy{suffix}"] == pytest.approx(sum(share * acc for share, _, acc in bins), abs=1e-6)
        for b, (share, conf, _) in enumerate(bins):  # each bin holds the confidences of its range
            assert share == 0 or b / BINS <= conf <= (b + 1) / BINS
    assert json.loads((tmp_path / "summary.json").read_text())["eval/ece"] == summary["eval/ece"]


def test_confidence_is_the_probability_of_the_greedy_response(make_config):
    """exp of the summed log-probs the policy gives its own greedy response, EOS included, as a
    fresh forward computes them."""
    module = module_from_config(make_config(*FAST_RUN, *EASY_TASK))
    examples = [module.source.example("validation", i) for i in range(4)]
    batch = collate_prompts(examples, module.tokenizer)
    assert bool(batch["prompt_mask"].all())  # prompts of one length: no padding to position around
    params = SamplingParams(max_new_tokens=8, greedy=True, temperature=0.0)
    scored = generate_and_score(module, batch, params)
    rollout = module.generate(batch["prompt_ids"], batch["prompt_mask"], params)
    ids = torch.cat([rollout.prompt_ids, rollout.response_ids], dim=1)
    mask = torch.cat([rollout.prompt_mask, rollout.response_mask], dim=1)
    with torch.no_grad():
        logits = module.policy(input_ids=ids, attention_mask=mask).logits.double()
    prompt_width = rollout.prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, prompt_width - 1:-1], dim=-1).gather(2, rollout.response_ids[..., None])[..., 0]
    expected = (logp * rollout.response_mask).sum(dim=1)  # compared as logs: an untrained policy's are tiny
    torch.testing.assert_close(torch.tensor(scored.confidence, dtype=torch.float64).log(), expected, rtol=1e-4, atol=1e-5)


def fake_run(root: Path, number: int, algorithm: str, seed: int, summary: dict) -> None:
    job = root / f"{number}_{algorithm}"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"algorithm={algorithm}", f"seed={seed}"]))
    (job / "summary.json").write_text(json.dumps({**summary, "choices": {"algorithm": algorithm}}))


def calibration_summary(start_bins: dict[int, tuple], end_bins: dict[int, tuple], ece: tuple, confidence: tuple,
                        accuracy: tuple) -> dict:
    """A summary.json with (share, confidence, accuracy) in the given bins, empty elsewhere."""
    summary = {"eval/ece_start": ece[0], "eval/ece": ece[1], "eval/confidence_start": confidence[0],
               "eval/confidence": confidence[1], "eval/accuracy_start": accuracy[0], "eval/accuracy": accuracy[1],
               "eval/response_len_start": 4.0, "eval/response_len": 4.0, "global_step": 4, "train_seconds": 1.0}
    for suffix, bins in (("_start", start_bins), ("", end_bins)):
        for b in range(BINS):
            share, conf, acc = bins.get(b, (0.0, 0.0, 0.0))
            summary.update({f"eval/reliability/bin{b:02d}/share{suffix}": share,
                            f"eval/reliability/bin{b:02d}/confidence{suffix}": conf,
                            f"eval/reliability/bin{b:02d}/accuracy{suffix}": acc})
    return summary


def test_report_has_a_calibration_table_and_a_reliability_diagram(tmp_path):
    root = tmp_path / "sweep"
    # two seeds of dpo: bin 9 holds 50% and 100% of their answers at 60% and 80% accuracy
    fake_run(root, 0, "dpo", 0, calibration_summary({2: (1.0, 0.25, 0.25)}, {5: (0.5, 0.55, 0.5), 9: (0.5, 0.95, 0.6)},
                                                    (0.0, 0.2), (0.25, 0.75), (0.25, 0.55)))
    fake_run(root, 1, "dpo", 1, calibration_summary({2: (1.0, 0.25, 0.25)}, {9: (1.0, 0.91, 0.8)},
                                                    (0.0, 0.11), (0.25, 0.91), (0.25, 0.8)))
    fake_run(root, 2, "sft", 0, calibration_summary({3: (1.0, 0.35, 0.3)}, {3: (1.0, 0.35, 0.3)},
                                                    (0.05, 0.05), (0.35, 0.35), (0.3, 0.3)))
    runs = [json.loads((root / name / "summary.json").read_text()) for name in ("0_dpo", "1_dpo")]
    # pooled over the seeds, each bin weighted by its share: bin 5 (0.5 of one run), bin 9 (0.5 and 1.0)
    confidence, accuracy, share = reliability_points(runs)
    assert confidence == pytest.approx([0.55, (0.5 * 0.95 + 1.0 * 0.91) / 1.5])
    assert accuracy == pytest.approx([0.5, (0.5 * 0.6 + 1.0 * 0.8) / 1.5])
    assert share == pytest.approx([0.25, 0.75])
    assert reliability_points(runs, "_start") == ([0.25], [0.25], [1.0])

    report = write_report(root)
    text = report.read_text()
    assert "## Calibration" in text and "![reliability](reliability.png)" in text
    assert "| algorithm | n | ECE start | ECE end | confidence start % | confidence end % |" in text
    assert "| dpo | 2 | 0.000 ± 0.000 | 0.155 ± 0.064 | 25.0 ± 0.0 | 83.0 ± 11.3 |" in text
    assert "| sft | 1 | 0.050 | 0.050 | 35.0 | 35.0 |" in text
    assert (report.parent / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_without_calibration_has_no_section(tmp_path):
    root = tmp_path / "sweep"
    fake_run(root, 0, "grpo", 0, {"eval/accuracy_start": 0.2, "eval/accuracy": 0.3, "global_step": 4})
    text = write_report(root).read_text()
    assert "## Calibration" not in text and not (root / "report" / "reliability.png").exists()
