"""An SFT start of the embedded model (a warm start, an embedded teacher), trained in a child
process whose CPU kernels are pinned, so that it is the same model, bit for bit, on every x86
machine, whatever its instruction set, its thread count or the run's accelerator.

Why a child process: the embedded task's SFT curve climbs in a jump whose timing is chaotic, so a
last-bit difference in one step's arithmetic moves the whole run. With the native kernels the
default warm start stopped at step 320 (held-out 30.5%) with AVX-512, 330 (28.9%) with AVX2 and 300
(25.4%) with ATen's portable kernels, on one machine; the same run in float64 diverged as much
(steps 250, 280, 530). Pinned, it stopped at step 270 (34.4%) with identical weights whether MKL ran
its AVX-512, AVX2 or SSE4.2 code and on 1 or 2 threads (docs/algorithms.md, "The warm start").
The kernels are chosen when torch loads, hence a fresh interpreter:

- ATen's vectorised kernels at their portable capability (`ATEN_CPU_CAPABILITY=default`): the
  reductions' order no longer follows the vector width;
- MKL's matrix products in its conditional-numerical-reproducibility mode (`MKL_CBWR=COMPATIBLE`:
  the same code path on every x86 CPU) and oneDNN's at SSE4.1;
- one thread, so no reduction is split by the core count.

It costs 2.4 times the native run's time (43 s against 18 s for the default warm start here), once:
the result is cached.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from posttrain.errors import PosttrainError
from posttrain.run.console import setup_console
from posttrain.run.precision import FP32

PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41",
                  "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# a job's process-group variables (torchrun, Lightning) and the scheduler's: the child is a job of
# one process, and Lightning would otherwise take it for a rank of the parent's
JOB_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def runs_pinned(sft_cfg: DictConfig) -> bool:
    """Whether the SFT run `sft_cfg` is pinned: the embedded model's are. A pretrained model's
    (`warm_start.pretrained`) runs in this process on the run's accelerator: a few steps of a
    large model, which one thread of portable kernels would make slow."""
    return not sft_cfg.model.get("name_or_path")


def pin_kernels(sft_cfg: DictConfig) -> None:
    """Set what the pinned run needs in the SFT config itself (part of its cache key): the CPU in
    fp32 (a bf16-mixed RL run, trainer=cpu_bf16, starts from the fp32 runs' start), one thread."""
    sft_cfg.trainer.accelerator = "cpu"
    sft_cfg.trainer.precision = FP32
    sft_cfg.num_threads = 1


def train_pinned(train: Callable[..., dict], sft_cfg: DictConfig, label: str) -> None:
    """Run `train(sft_cfg, announce=False)` in a child interpreter with `PINNED_KERNELS`; its
    output is this process's. `train` must be importable by name (the recipe's `run`)."""
    output_dir = Path(sft_cfg.paths.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    config = output_dir / "pinned_sft.yaml"
    OmegaConf.save(sft_cfg, config, resolve=True)
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES and not k.startswith("SLURM_")}
    env.update(PINNED_KERNELS)
    command = [sys.executable, "-m", "posttrain.prepare.pinned", importable_name(train), str(config)]
    exit_code = subprocess.run(command, env=env).returncode
    if exit_code != 0:
        raise PosttrainError(f"{label}: its SFT run (a child process with pinned CPU kernels: prepare/pinned.py) "
                             f"exited with {exit_code}; its error is printed above")
    config.unlink()


def importable_name(function: Callable) -> str:
    """"module:name" of `function`, as the child imports it; under `python -m posttrain.train` its
    module is `__main__`, whose real name is in its spec."""
    module = function.__module__
    if module == "__main__" and getattr(sys.modules["__main__"], "__spec__", None) is not None:
        module = sys.modules["__main__"].__spec__.name
    return f"{module}:{function.__qualname__}"


def main(target: str, config: str) -> None:
    """The child: import the recipe's `run` from "module:name" and train the saved config."""
    console = logging.StreamHandler()
    console.setLevel(logging.WARNING)  # the parent logs the start and the end; Lightning's banner stays out
    logging.basicConfig(handlers=[console], format="%(message)s")
    setup_console()
    module, _, name = target.partition(":")
    train = getattr(importlib.import_module(module), name)
    try:
        train(OmegaConf.load(config), announce=False)
    except PosttrainError as err:  # the user's mistake: one line, as the CLI prints it
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main(*sys.argv[1:])
