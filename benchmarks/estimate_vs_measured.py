"""posttrain-estimate's predictions against measured training steps on this CPU.

    python benchmarks/estimate_vs_measured.py --case tiny --json benchmarks/results/estimate/tiny.json
    python benchmarks/estimate_vs_measured.py --case smollm2 --json benchmarks/results/estimate/smollm2.json

Each case is a short `posttrain` run (`posttrain.train.run` on the composed config: the real
loader, module, sampler and optimiser) of `--steps` rollout batches. What is measured is the
memory of live tensors, not the process's RSS: on a CPU the RSS is mostly libraries and what
the allocator keeps after a free, which no estimate of tensors can predict.

* At the start of each profiled step, every live tensor reachable from Python is summed (its
  storage counted once: views and tied weights share one): the weights, AdamW's moments.
* During the step, `torch.profiler` with `profile_memory=True` records every allocation and
  free of the CPU allocator; their running sum from the step's start, plus that baseline, is
  the live tensor bytes at each moment, and its maximum within each stage (collect = generate,
  annotate, update) is that stage's measured peak.

The first step is not profiled (AdamW allocates its moments there, as the estimate's
steady state already counts them) and the last one is timed without the profiler: its wall
time is compared with the estimate's lower bound for this CPU (reported, not asserted).

The runs are made comparable with the estimate, which assumes every response uses the
whole budget: the stop tokens are replaced by one no token equals (responses run to the
budget), the repetition stop is off, and the update runs even on a batch without a reward
spread (a random-init model earns no reward; skipping would skip the backward). The estimate
is then taken at the prompt and response widths the run had.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
# The measured configurations. tiny: the embedded model with activations that matter (128 rows
# of 96 response tokens); smollm2: the packaged SmolLM2-135M-Instruct at a small batch (2 CPU cores).
CASES = {
    "tiny": ["algorithm=grpo", "algorithm.warm_start.steps=0", "algorithm.prompts_per_step=16",
             "algorithm.group_size=8", "data.max_response_tokens=96"],
    "tiny_ckpt": ["algorithm=grpo", "algorithm.warm_start.steps=0", "algorithm.prompts_per_step=16",
                  "algorithm.group_size=8", "data.max_response_tokens=96", "model.gradient_checkpointing=true"],
    "smollm2": ["experiment=grpo_smollm2", "algorithm.prompts_per_step=2", "algorithm.group_size=4",
                "data.max_response_tokens=32"],
}
COMMON = ["logger=none", "callbacks.progress_bar=none", "eval.at_start=false", "eval.num_prompts=4",
          "eval.batch_size=4", "rollout.repetition.ngram=null"]
STAGES = ("collect", "annotate", "update")
NO_STOP_TOKEN = -1  # a token id no sampled token equals: every response runs to the budget


def live_tensor_bytes() -> int:
    """Bytes of the storages of every tensor reachable from Python, each storage once."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        # type(), not isinstance: the latter asks deprecated module proxies for their __class__
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            with contextlib.suppress(RuntimeError):  # a tensor without storage (a wrapper subclass)
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class StepRecorder:
    """Wraps the online module's step and stages: profiles steps `profiled` (1-based), marks each
    stage as a profiler range, takes each profiled step's baseline, and times the others."""

    def __init__(self, profiled: set[int]):
        self.profiled = profiled
        self.step = 0
        self.profiler = None
        self.baselines: dict[int, int] = {}
        self.seconds: dict[int, float] = {}
        self.widths: dict[int, tuple[int, int, int]] = {}

    @contextlib.contextmanager
    def installed(self, module_class, stop_token_modules):
        """The wrappers in place for the duration of the run, the originals put back after it."""
        saved = {name: getattr(module_class, name) for name in ("training_step", *STAGES)}
        stop_tokens = [(module, module.stop_token_ids) for module in stop_token_modules]
        self.install(module_class)
        for module, _ in stop_tokens:  # the sampler's stop tokens (base.generate) and the collector's
            module.stop_token_ids = lambda tokenizer, model: [NO_STOP_TOKEN]
        try:
            yield
        finally:
            for name, method in saved.items():
                setattr(module_class, name, method)
            for module, original in stop_tokens:
                module.stop_token_ids = original

    def install(self, module_class) -> None:
        recorder = self
        original_step = module_class.training_step

        def training_step(module, ticket, batch_idx):
            recorder.step += 1
            step = recorder.step
            if step in recorder.profiled:
                if recorder.profiler is None:
                    recorder.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                    recorder.profiler.start()
                recorder.baselines[step] = live_tensor_bytes()
                with record_function(f"estimate:step:{step}"):
                    return original_step(module, ticket, batch_idx)
            if recorder.profiler is not None:
                recorder.profiler.stop()
                recorder.events = recorder.profiler.profiler.kineto_results.events()
                recorder.profiler = None
            started = time.perf_counter()
            out = original_step(module, ticket, batch_idx)
            recorder.seconds[step] = time.perf_counter() - started
            return out

        module_class.training_step = training_step
        for stage in STAGES:
            setattr(module_class, stage, self.marked(stage, getattr(module_class, stage)))
        original_annotate = module_class.annotate

        def annotate(module, exp):
            recorder.widths[recorder.step] = (exp.prompt_ids.shape[1], exp.response_ids.shape[1], len(exp))
            return original_annotate(module, exp)

        module_class.annotate = annotate

    def marked(self, stage: str, method):
        def wrapped(module, *args):
            if stage == "update":  # a batch without reward spread still runs its backward
                args = (args[0], True)
            with record_function(f"estimate:{stage}"):
                return method(module, *args)

        return wrapped

    def peaks(self) -> dict[int, dict[str, int]]:
        """Per profiled step: the live tensor bytes' peak within it and within each stage."""
        events = sorted(self.events, key=lambda e: e.start_ns())
        times, live, running = [], [], 0
        for e in events:
            if e.name() == "[memory]" and e.device_type().name == "CPU":
                running += e.nbytes()
                times.append(e.start_ns())
                live.append(running)
        ranges = [(e.name().split(":")[1:], e.start_ns(), e.end_ns()) for e in events
                  if e.name().startswith("estimate:")]

        def level_before(at: int) -> int:  # the running sum just before `at`
            i = bisect.bisect_left(times, at)
            return live[i - 1] if i else 0

        result = {}
        for name, start, end in ranges:
            if name[0] != "step":
                continue
            step, start_level = int(name[1]), level_before(start)
            peaks = {}
            for stage, s, e in ranges:
                if stage[0] == "step" or s < start or e > end:
                    continue
                inside = live[bisect.bisect_left(times, s):bisect.bisect_right(times, e)]
                peaks[stage[0]] = max([level_before(s), *inside]) - start_level + self.baselines[step]
            peaks["step"] = max(peaks.values())
            result[step] = peaks
        return result


def composed(overrides: list[str], output_dir: Path):
    from omegaconf import open_dict

    from posttrain.estimate.estimator import composed_config

    cfg = composed_config(overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
    return cfg


def measure(case: str, steps: int, threads: int, extra: list[str]) -> dict:
    from posttrain import train
    from posttrain.algorithms import base, online
    from posttrain.algorithms.online import module as online_module
    from posttrain.estimate.estimator import estimate

    torch.set_num_threads(threads)
    overrides = CASES[case] + COMMON + [f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
                                        f"callbacks.checkpoint.every_n_train_steps={steps + 1}", f"num_threads={threads}",
                                        *extra]
    recorder = StepRecorder(profiled=set(range(2, steps)))
    with recorder.installed(online.OnlineRLModule, (base, online_module)), tempfile.TemporaryDirectory() as run_dir:
        cfg = composed(overrides, Path(run_dir))
        started = time.perf_counter()
        train.run(cfg, announce=False)
        run_seconds = time.perf_counter() - started
    peaks = recorder.peaks()
    prompt_tokens = max(w[0] for s, w in recorder.widths.items() if s in peaks)
    response_tokens = max(w[1] for s, w in recorder.widths.items() if s in peaks)
    predicted = estimate(cfg, prompt_tokens=prompt_tokens, response_tokens=response_tokens, device="cpu")
    stage_of = {"collect": "generate", "annotate": "annotate", "update": "update"}
    measured = {name: max(p.get(name, 0) for p in peaks.values()) for name in (*STAGES, "step")}
    compare = {}
    for stage, predicted_stage in stage_of.items():
        # a stage the estimate leaves out holds no more than the weights and moments it starts with
        compare[predicted_stage] = comparison(predicted.peak.get(predicted_stage, baseline_of(predicted)),
                                              measured[stage])
    training_peak = max(predicted.peak.get(s, 0) for s in stage_of.values())
    compare["step peak"] = comparison(training_peak, measured["step"])
    timed = [s for s in recorder.seconds if s > 1]
    return {"case": case, "overrides": overrides, "threads": threads, "torch": torch.__version__,
            "widths": {"prompt_tokens": prompt_tokens, "response_tokens": response_tokens,
                       "rows": max(w[2] for w in recorder.widths.values())},
            "measured_bytes": {str(step): p for step, p in peaks.items()}, "baselines": {str(step): b for step, b in recorder.baselines.items()},
            "predicted": {"peak": predicted.peak, "memory": predicted.memory, "activations": predicted.activations,
                          "flops": predicted.flops, "seconds_lower_bound": predicted.seconds["cpu"],
                          "roles": predicted.roles},
            "memory": compare,
            "seconds": {"measured_step_s": [recorder.seconds[s] for s in timed],
                        "lower_bound_step_s": predicted.seconds["cpu"]["step"]},
            "run_seconds": run_seconds}


def baseline_of(predicted) -> float:
    """What the estimate holds through every stage: the roles' weights and AdamW moments."""
    update = predicted.memory["update"]
    return sum(v for k, v in update.items() if k.endswith(("weights", "AdamW moments")) and "fused" not in k)


def comparison(predicted: float, measured: float) -> dict:
    return {"predicted_mib": round(predicted / 2**20, 2), "measured_mib": round(measured / 2**20, 2),
            "error_pct": round(100 * (predicted - measured) / measured, 1) if measured else None}


def print_table(result: dict) -> None:
    print(f"{result['case']}: prompt {result['widths']['prompt_tokens']} + response "
          f"{result['widths']['response_tokens']} tokens, {result['widths']['rows']} rows")
    print(f"{'stage':<12}{'predicted MiB':>15}{'measured MiB':>15}{'error':>9}")
    for stage, row in result["memory"].items():
        print(f"{stage:<12}{row['predicted_mib']:>15.1f}{row['measured_mib']:>15.1f}{row['error_pct']:>8.1f}%")
    seconds = result["seconds"]
    print(f"seconds per step: measured {', '.join(f'{s:.2f}' for s in seconds['measured_step_s'])}; "
          f"lower bound {seconds['lower_bound_step_s']:.3f}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), default="tiny")
    parser.add_argument("--steps", type=int, default=4, help="rollout batches: the first and last unprofiled")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("overrides", nargs="*", help="further overrides of the case's config")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps: at least 3 (the first and the last are not profiled)")
    result = measure(args.case, args.steps, args.threads, args.overrides)
    print_table(result)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
