"""The embedded model's SFT starts (a warm start, an embedded teacher) train in a child process
with pinned CPU kernels (prepare/pinned.py): a function of their config, the same weights bit for
bit on another machine's instruction set, and a failure in the child is the parent's error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.errors import PosttrainError
from posttrain.prepare import pinned
from posttrain.prepare.pinned import train_pinned
from posttrain.prepare.warm_start import warm_start
from posttrain.train import run

from conftest import EASY_TASK, FAST_RUN

WARM_START = (*FAST_RUN, *EASY_TASK, "algorithm=grpo", "algorithm.warm_start.steps=12",
              "algorithm.warm_start.eval_every=4", "algorithm.warm_start.until_accuracy=1.0")


def test_a_warm_start_is_the_same_model_on_another_instruction_set(make_config, tmp_path, monkeypatch):
    """Trained twice into two caches, held-out evaluations between its steps as the accuracy
    target makes them: the same weights, also when MKL runs the code of a CPU without AVX-512
    and ATen's kernels are asked for AVX2 (what a different machine would pick by itself),
    which, unpinned, give other weights."""

    def weights(cache: str, *more: str) -> dict:
        directory = warm_start(make_config(*WARM_START, *more, f"paths.cache_dir={tmp_path}/{cache}"), run)
        return load_file(str(next(Path(directory).glob("*.safetensors"))))

    def elsewhere(cache: str) -> dict:
        with monkeypatch.context() as env:
            env.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")  # MKL's own dispatch: the matrix products of an AVX2 CPU
            env.setenv("ATEN_CPU_CAPABILITY", "avx2")
            return weights(cache)

    here, there = weights("here"), elsewhere("there")
    assert here.keys() == there.keys() and all(torch.equal(here[k], there[k]) for k in here)
    other_seed = weights("other_seed", "algorithm.warm_start.seed=1")
    assert not all(torch.equal(here[k], other_seed[k]) for k in here)  # its own seed is part of its config
    # the control: unpinned, the child's kernels are the machine's, and the two machines differ
    monkeypatch.setattr(pinned, "PINNED_KERNELS", {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    native_here, native_there = weights("native_here"), elsewhere("native_there")
    assert not all(torch.equal(native_here[k], native_there[k]) for k in here)


def test_a_failed_pinned_run_is_an_error_naming_it(make_config, tmp_path, capfd):
    """The child's error is printed in one line and raised here, naming the warm start; the
    config it was handed is left for a look."""
    cfg = make_config(*FAST_RUN, "trainer.max_steps=-3", output_dir=tmp_path / "run")
    with pytest.raises(PosttrainError, match="Warm start: its SFT run .* exited with 2"):
        train_pinned(run, cfg, "Warm start")
    assert "trainer.max_steps" in capfd.readouterr().err
    assert (tmp_path / "run" / "pinned_sft.yaml").is_file()
