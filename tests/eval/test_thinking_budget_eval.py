"""`posttrain-eval thinking_budget=[...]`: held-out greedy accuracy against a cap on the
reasoning tokens (rollout/thinking.py), on the embedded verbose task, whose column steps are
the reasoning and whose answer marker '>' ends it."""

import json
import subprocess
import sys
from pathlib import Path

from forked_cli import run_command

VERBOSE_TASK = ["data.style=verbose", "data.min_digits=1", "data.max_digits=1", "data.max_response_tokens=12",
                "eval.num_prompts=16", "eval.batch_size=16", "pass_k=[]"]


def posttrain_eval(*args: str, log_dir: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "posttrain.eval.evaluate", *args, "num_threads=1", f"paths.log_dir={log_dir}"]
    return run_command(command, capture_output=True, text=True, timeout=300)


def test_accuracy_is_reported_against_the_thinking_budget(embedded_hf_model, tmp_path):
    result = posttrain_eval(f"checkpoint={embedded_hf_model}", *VERBOSE_TASK, "thinking_budget=[0,4,12]",
                            log_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = tmp_path.glob("eval/runs/*/eval.json")
    results = json.loads(path.read_text())
    assert results["thinking_budgets"] == [0, 4, 12] and results["end_of_thinking"] == ">"
    # a budget as large as the generation budget is plain greedy decoding
    for name in ("accuracy", "response_len"):
        assert results[f"eval/thinking@12/{name}"] == results[f"eval/{name}"], name
    assert results["eval/thinking@12/forced_frac"] == 0.0
    assert results["eval/thinking@0/forced_frac"] == 1.0  # no reasoning at all: '>' comes first
    assert 0.0 <= results["eval/thinking@4/forced_frac"] <= 1.0
    assert "thinking budget 4" in result.stdout  # a row of the table per budget


def test_a_task_without_an_end_of_thinking_marker_asks_for_one(embedded_hf_model, tmp_path):
    result = posttrain_eval(f"checkpoint={embedded_hf_model}", "eval.num_prompts=16", "eval.batch_size=16",
                            "pass_k=[]", "thinking_budget=8", log_dir=tmp_path)
    assert result.returncode == 1
    assert "end_of_thinking" in result.stderr and "Traceback" not in result.stderr
