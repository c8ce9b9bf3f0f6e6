"""bf16 on the CPU as a choice (run/precision.py, trainer=cpu_bf16): kept where the CPU has native
bf16, 32-true with a line saying so where it has not; the reference scored in the policy's
precision, so the first step's KL is exactly 0 under bf16-mixed as under fp32."""

import json
from pathlib import Path

import pytest
import torch

from posttrain.run import precision


def test_bf16_mixed_is_kept_on_a_cpu_with_native_bf16_and_falls_back_to_fp32_without(monkeypatch):
    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: "AVX512-BF16")
    assert precision.cpu_precision("bf16-mixed", "cpu") == ("bf16-mixed", None)
    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: None)
    kept, why = precision.cpu_precision("bf16-mixed", "cpu")
    assert kept == "32-true" and "no native bf16" in why and "trainer.precision=bf16-mixed" in why
    assert precision.cpu_precision("32-true", "cpu") == ("32-true", None)  # nothing else changes
    assert precision.cpu_precision("bf16-true", "cpu") == ("bf16-true", None)
    assert precision.cpu_precision("bf16-mixed", "gpu") == ("bf16-mixed", None)  # not the CPU's business
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert precision.cpu_precision("bf16-mixed", "auto")[0] == "32-true"  # auto without CUDA is the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert precision.cpu_precision("bf16-mixed", "auto") == ("bf16-mixed", None)


@pytest.mark.parametrize("amx, avx512_bf16, arm_features, found", [
    (True, False, "fp asimd", "AMX"),
    (False, True, "fp asimd", "AVX512-BF16"),
    (False, False, "fp asimd sve bf16 i8mm", "ARM BF16"),
    (False, False, "fp asimd sve", None),
])
def test_native_bf16_is_read_from_the_cpu(monkeypatch, tmp_path, amx, avx512_bf16, arm_features, found):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nFeatures\t: {arm_features}\nCPU implementer\t: 0x41\n")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(precision, "CPUINFO", cpuinfo)
    assert precision.native_cpu_bf16() == found


def first_step_metrics(cfg) -> dict:
    from posttrain.train import run

    run(cfg)
    rows = [json.loads(line) for line in (Path(cfg.paths.output_dir) / "metrics.jsonl").read_text().splitlines()]
    return next(row for row in rows if row.get("step") == 1 and "policy/kl" in row)


def test_without_native_bf16_the_run_says_so_and_trains_in_fp32(make_config, sft_start, monkeypatch, capsys, caplog):
    from conftest import rl_config

    from posttrain.algorithms.online import OnlineRLModule

    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: None)
    seen = []
    training_step = OnlineRLModule.training_step

    def recording(self, *args, **kwargs):
        seen.append((self.trainer.precision, torch.is_autocast_enabled("cpu")))
        return training_step(self, *args, **kwargs)

    monkeypatch.setattr(OnlineRLModule, "training_step", recording)
    with caplog.at_level("INFO", logger="posttrain"):
        first_step_metrics(rl_config(make_config, sft_start, "algorithm=grpo", "trainer=cpu_bf16",
                                     "trainer.max_steps=1"))
    assert "this CPU has no native bf16" in capsys.readouterr().out
    run_line = next(line for line in caplog.text.splitlines() if "algorithm=grpo" in line)
    assert "precision" not in run_line  # it trains in fp32, which goes unsaid
    assert seen == [("32-true", False)]


@pytest.mark.parametrize("reference_in_fp32", [False, True])
def test_under_bf16_mixed_the_reference_is_scored_in_the_policys_precision(make_config, sft_start, monkeypatch,
                                                                          caplog, reference_in_fp32):
    """At the first step the policy is the reference: in one precision their log-probs are the
    same numbers and k3 is exactly 0. The control scores the reference outside the autocast
    (fp32 against the policy's bf16): a rounding gap, so the assertion can fail."""
    from conftest import rl_config

    from posttrain.algorithms.online import OnlineRLModule

    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: "test")  # bf16 even where it is emulated
    if reference_in_fp32:
        annotate = OnlineRLModule.annotate

        def in_fp32(self, exp):
            with torch.autocast("cpu", enabled=False):
                return annotate(self, exp)

        monkeypatch.setattr(OnlineRLModule, "annotate", in_fp32)
    cfg = rl_config(make_config, sft_start, "algorithm=grpo", "kl_estimator=k3", "trainer=cpu_bf16",
                    "trainer.max_steps=1")
    with caplog.at_level("INFO", logger="posttrain"):
        kl = first_step_metrics(cfg)["policy/kl"]
    assert "trainer.precision=bf16-mixed" in caplog.text  # the run line says what trains
    if reference_in_fp32:
        assert kl > 1e-6
    else:
        assert kl == 0.0
