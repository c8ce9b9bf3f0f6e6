"""Asynchronous rollouts and partial rollouts, measured through the `posttrain` command.

    python benchmarks/async_rollouts.py async   [--experiment grpo_tiny] [--steps 200] [--eval-every 50]
                                                [--seeds 0 1 2] [--out DIR]
    python benchmarks/async_rollouts.py partial [--steps 60] [--budget 8] [--seeds 0] [--out DIR]

`async`: `experiment=grpo_tiny` (its cached SFT warm start and its batch, 32 prompts x 8 samples
since 2026-12-02: the figures of 2026-11-27 in docs/results.md ran 8 x 16; or the
--experiment given, e.g. outcome_rl, whose responses are 4 to 7 times longer) on this
machine's 2 cores, two ways per seed, one after the other:

    sync     the synchronous pipeline (rollout.max_staleness=0), 2 torch threads
    async    rollout.max_staleness=1: a producer process with 1 thread samples while the
             trainer, with 1 thread, trains (one core each)
    async_tis  the same, each token weighted by truncated IS for its staleness
             (rollout.correction.tis=token; only with --modes ... async_tis)

and reports rollout batches per minute (from the stage seconds of every batch after the
first, which pays for the producer's start-up; and from the wall clock, evaluations
included), the mean staleness, and held-out accuracy against batches (= samples: every
batch has 128) and against the wall clock.

`partial`: `experiment=outcome_rl` (the verbose task: solutions of 8 to 29 tokens, budget 32),
with and without `rollout.partial_budget` tokens per generate call: the share of responses
continued from an earlier call, the longest generate call per batch (how long a batch waits
for its longest response), the staleness the continuation brings, and held-out accuracy.

Each run's directory (config, metrics.jsonl, summary.json) stays under --out (a run whose
summary.json exists is read, not run again); the tables go to stdout and to
<out>/async_<experiment>.json or <out>/partial<budget>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STAGES = ("perf/collect_s", "perf/annotate_s", "perf/advantages_s", "perf/update_s")


def run(name: str, overrides: list[str], threads: int, out: Path) -> Path:
    """One `posttrain` run in out/name (skipped when its summary.json exists)."""
    run_dir = out / name
    if (run_dir / "summary.json").exists():
        return run_dir
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    command = ["posttrain", *overrides, "logger=csv", "callbacks.progress_bar=none", f"hydra.run.dir={run_dir}"]
    print("+", " ".join(command), f"(threads {threads})", flush=True)
    started = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (run_dir / "command_s.txt").write_text(f"{time.perf_counter() - started:.1f}\n")
    return run_dir


def read_run(run_dir: Path) -> dict:
    """Training rows (by batch) and held-out accuracy (by batch) of a run's metrics.jsonl."""
    train, accuracy = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "eval/accuracy" in row:
            accuracy[int(row["step"])] = row["eval/accuracy"]
        if "perf/collect_s" in row:
            train[int(row["rollout/batch"])] = row
    command_s = run_dir / "command_s.txt"
    return {"train": train, "accuracy": accuracy,
            "command_s": float(command_s.read_text()) if command_s.exists() else float("nan")}


def throughput(train: dict) -> dict:
    """Batches per minute after the first batch: from stage seconds, and from the wall clock."""
    batches = sorted(train)[1:]
    stage_s = sum(sum(train[b][k] for k in STAGES) for b in batches)
    wall_s = train[batches[-1]]["perf/elapsed_s"] - train[batches[0] - 1]["perf/elapsed_s"]
    return {"batches_per_min": 60 * len(batches) / stage_s, "batches_per_min_wall": 60 * len(batches) / wall_s}


def accuracy_at(data: dict) -> list[dict]:
    """[{batch, elapsed_s, accuracy}] at each evaluation (batch 0: before training, 0 s)."""
    points = []
    for batch, value in sorted(data["accuracy"].items()):
        elapsed = data["train"][batch]["perf/elapsed_s"] if batch in data["train"] else 0.0
        points.append({"batch": batch, "elapsed_s": elapsed, "accuracy": value})
    return points


def mean_of(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else float("nan")


def study_async(args) -> dict:
    modes = {"sync": ([], 2), "async": (["rollout.max_staleness=1", "rollout.producer_threads=1"], 1),
             "async_tis": (["rollout.max_staleness=1", "rollout.producer_threads=1", "rollout.correction.tis=token"], 1)}
    results = {}
    for seed in args.seeds:  # the modes alternate: the machine's drift falls on all alike
        for mode in args.modes:
            extra, threads = modes[mode]
            overrides = [f"experiment={args.experiment}", f"trainer.max_steps={args.steps}",
                         f"trainer.val_check_interval={args.eval_every}", f"seed={seed}", *extra]
            data = read_run(run(f"{mode}_seed{seed}", overrides, threads, args.out))
            rows = list(data["train"].values())
            results[f"{mode}_seed{seed}"] = {
                "mode": mode, "seed": seed, **throughput(data["train"]),
                "staleness_mean": mean_of(rows, "rollout/staleness_mean"),
                "generate_s": mean_of(rows, "perf/generate_s"), "collect_s": mean_of(rows, "perf/collect_s"),
                "update_s": mean_of(rows, "perf/update_s"), "command_s": data["command_s"],
                "curve": accuracy_at(data)}
    print_async(results)
    return results


def print_async(results: dict) -> None:
    print("\n| run | batches/min (stages) | batches/min (wall) | staleness | collect s | update s | command s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['batches_per_min']:.1f} | {r['batches_per_min_wall']:.1f} | "
              f"{r['staleness_mean']:.2f} | {r['collect_s']:.3f} | {r['update_s']:.3f} | {r['command_s']:.0f} |")
    for mode in dict.fromkeys(r["mode"] for r in results.values()):
        runs = [r for r in results.values() if r["mode"] == mode]
        if not runs:
            continue
        rate = [r["batches_per_min"] for r in runs]
        print(f"\n{mode}: {statistics.mean(rate):.1f} batches/min (stages) over {len(runs)} seeds; "
              f"held-out accuracy (%) at batch [s]:")
        for point in zip(*(r["curve"] for r in runs)):
            values = [100 * p["accuracy"] for p in point]
            seconds = [p["elapsed_s"] for p in point]
            print(f"  batch {point[0]['batch']:4d}: " + " / ".join(f"{v:.1f} [{s:.0f} s]"
                                                                 for v, s in zip(values, seconds))
                  + f"  mean {statistics.mean(values):.1f} at {statistics.mean(seconds):.0f} s")


def study_partial(args) -> dict:
    modes = {"whole": [], f"partial{args.budget}": [f"rollout.partial_budget={args.budget}"]}
    results = {}
    for mode, extra in modes.items():
        for seed in args.seeds:
            overrides = ["experiment=outcome_rl", f"trainer.max_steps={args.steps}",
                         f"trainer.val_check_interval={args.eval_every}", f"seed={seed}", *extra]
            data = read_run(run(f"{mode}_seed{seed}", overrides, 2, args.out))
            rows = list(data["train"].values())
            longest = [r.get("perf/longest_generate_s", r["perf/collect_s"]) for r in rows]
            results[f"{mode}_seed{seed}"] = {
                "mode": mode, "seed": seed, **throughput(data["train"]),
                "continued_frac": mean_of(rows, "rollout/continued_frac"),
                "longest_generate_s_mean": sum(longest) / len(longest), "longest_generate_s_max": max(longest),
                "collect_s": mean_of(rows, "perf/collect_s"),
                "staleness_mean": mean_of(rows, "rollout/staleness_mean"),
                "response_len": mean_of(rows, "rollout/response_len_mean"), "curve": accuracy_at(data)}
    print("\n| run | continued | longest call s (mean / max) | collect s | staleness | batches/min | final acc |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {100 * r['continued_frac']:.1f}% | {r['longest_generate_s_mean']:.3f} / "
              f"{r['longest_generate_s_max']:.3f} | {r['collect_s']:.3f} | {r['staleness_mean']:.2f} | "
              f"{r['batches_per_min']:.1f} | {100 * r['curve'][-1]['accuracy']:.1f}% |")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", choices=("async", "partial"))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--budget", type=int, default=8, help="partial: rollout.partial_budget")
    parser.add_argument("--experiment", default="grpo_tiny", help="async: the preset run both ways")
    parser.add_argument("--modes", nargs="+", default=["sync", "async"], choices=("sync", "async", "async_tis"),
                        help="async: the arms (async_tis: async with rollout.correction.tis=token)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    defaults = {"async": (200, 50, [0, 1, 2]), "partial": (60, 20, [0])}[args.study]
    args.steps = args.steps or defaults[0]
    args.eval_every = args.eval_every or defaults[1]
    args.seeds = args.seeds or defaults[2]
    args.out = (args.out or Path("benchmarks/results/async_rollouts")).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    results = study_async(args) if args.study == "async" else study_partial(args)
    name = f"partial{args.budget}" if args.study == "partial" else f"async_{args.experiment}"
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
