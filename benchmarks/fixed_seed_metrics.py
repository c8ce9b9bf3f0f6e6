"""Fixed-seed metrics of short online runs, one case per capability of the online learner, to
check that a refactor changes no number.

    python benchmarks/fixed_seed_metrics.py run --out before.json     # on the old code
    python benchmarks/fixed_seed_metrics.py run --out after.json      # on the new code
    python benchmarks/fixed_seed_metrics.py compare before.json after.json

Each case trains a few rollout batches from the untrained tiny model (no warm start) with the
real CLI and keeps every logged metric of metrics.jsonl except the timings. `compare` prints
each metric that differs (to the last digit of its JSON repr) and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = ["algorithm.warm_start.steps=0", "trainer.max_steps=3", "trainer.val_check_interval=1000",
          "eval.num_prompts=16", "eval.at_start=false", "eval.log_samples=0", "eval.panel.size=0", "logger=csv",
          "algorithm.prompts_per_step=4", "algorithm.group_size=4", "seed=3", "num_threads=1"]
# case name -> overrides; the teacher cases get roles.teacher.name_or_path=<an exported tiny model>
CASES: dict[str, list[str]] = {
    "grpo": ["experiment=grpo_tiny"],
    "ppo_critic_gae": ["experiment=ppo_tiny"],
    "ppo_shared_critic": ["experiment=ppo_tiny", "roles.critic.shared_backbone=true"],
    "dapo_dynamic_sampling": ["algorithm=dapo", "data_curriculum=dynamic_sampling"],  # on the total reward: an untrained policy is never right
    "gspo_minibatches": ["algorithm=gspo", "algorithm.num_minibatches=2", "algorithm.ppo_epochs=2",
                         "algorithm.micro_batch_size=3"],
    "kl_in_reward_adaptive": ["algorithm=grpo", "kl_estimator=k1", "kl_estimator.placement=in_reward",
                              "kl_estimator.controller=adaptive", "kl_estimator.target=0.01",
                              "kl_estimator.horizon=100"],
    "ptx": ["algorithm=grpo", "algorithm.ptx_coef=0.5", "algorithm.ptx_batch_size=4"],
    "constraint": ["algorithm=grpo", "reward=length_constraint"],
    "mismatch_tis_bf16": ["algorithm=grpo", "rollout.dtype=bfloat16", "rollout.correction.tis=token",
                          "rollout.mismatch_budget.kl=0.0"],
    "offpolicy_mask_entropy": ["algorithm=grpo", "algorithm.offpolicy_mask_delta=0.0", "algorithm.entropy_coef=0.01",
                               "algorithm.mask_truncated=true"],
    "prm_steps": ["experiment=prm_rl"],
    "partial_rollouts": ["algorithm=grpo", "rollout.partial_budget=3"],
    "async_producer": ["algorithm=grpo", "rollout.max_staleness=1"],
    "opd_reward": ["algorithm=opd"],
    "kdrl_loss": ["algorithm=kdrl"],
    "distill_full": ["algorithm=opd", "algorithm.distill.mode=full", "advantage=group_norm"],
    "long2short": ["algorithm=long2short"],
    "curriculum_pass_rate": ["algorithm=grpo", "data_curriculum=pass_rate_filter", "data_curriculum.low=0.0",
                             "data_curriculum.pool_size=32"],
}
TEACHER_CASES = ("opd_reward", "kdrl_loss", "distill_full")  # long2short reads no teacher (distill.coef=0)


def run_case(name: str, overrides: list[str], work: Path, teacher: Path | None) -> dict:
    out = work / name
    extra = [f"roles.teacher.name_or_path={teacher}", "teacher=null"] if name in TEACHER_CASES else []
    command = ["posttrain", *overrides, *COMMON, *extra, f"hydra.run.dir={out}", f"paths.cache_dir={work}/cache"]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "offline"})
    if result.returncode != 0:
        return {"error": result.stderr[-2000:]}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {f"{i}:{k}": v for i, row in enumerate(rows) for k, v in sorted(row.items())
            if not k.startswith("perf/") or k in ("perf/skipped_update", "perf/nonfinite_grad_steps")}


def export_teacher(work: Path) -> Path:
    out = work / "teacher_run"
    subprocess.run(["posttrain", "algorithm=sft", "trainer.max_steps=2", "eval.num_prompts=8", "eval.at_start=false",
                    "logger=none", f"hydra.run.dir={out}", f"paths.cache_dir={work}/cache"], check=True,
                   capture_output=True)
    found = sorted(out.rglob("config.json"))
    return found[0].parent


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--out", required=True)
    run.add_argument("--cases", nargs="*", default=list(CASES))
    compare = sub.add_parser("compare")
    compare.add_argument("before")
    compare.add_argument("after")
    args = parser.parse_args()
    if args.command == "compare":
        before, after = (json.loads(Path(p).read_text()) for p in (args.before, args.after))
        differ = 0
        for case in before:
            b, a = before[case], after.get(case, {"error": "missing"})
            keys = sorted(set(b) | set(a), key=lambda k: (int(k.split(":")[0]) if ":" in k else -1, k))
            bad = [k for k in keys if b.get(k) != a.get(k)]
            print(f"{case}: {'equal' if not bad else f'{len(bad)} of {len(keys)} differ'} ({len(keys)} values)")
            for k in bad[:10]:
                print(f"    {k}: {b.get(k)!r} -> {a.get(k)!r}")
            differ += bool(bad)
        sys.exit(1 if differ else 0)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        teacher = export_teacher(work) if set(args.cases) & set(TEACHER_CASES) else None
        results = {}
        for name in args.cases:
            results[name] = run_case(name, CASES[name], work, teacher)
            status = results[name].get("error", f"{len(results[name])} values")
            print(f"{name}: {status if len(status) < 200 else status[-400:]}", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
