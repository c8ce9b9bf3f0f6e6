"""Memory and time of one GRPO-style training forward + backward against the response length.

One step: 16 responses (2 prompts x 8 samples, a 64-token prompt each, every response the full
length), log-probs of the response tokens (and the entropy, without gradient, as
`OnlineRLModule.training_forward` takes it), a policy-gradient loss, its backward. Three forwards
(and, on request, a variant of the second):

* ``old``  posttrain before issue 27: the grouped forward with explicit attention (scores
           [rows, heads, T, T] per layer, kept for the backward), the whole [B, T, V] logits,
           then `core.token_logprobs_and_entropy` (fp32 chunk by chunk). The file is read from
           git (``git show <rev>:src/posttrain/models/grouped_forward.py``) into a temporary module.
* ``new``  `posttrain.models.forward.sequence_logprobs`: the grouped forward with SDPA and
           one shared mask, hidden states, the LM head chunk by chunk inside the checkpoint.
* ``new+ckpt`` (only when asked for) ``new`` with the model's activation checkpointing on: each
           layer's step recomputed in the backward (`model.gradient_checkpointing=true`).
* ``new+selective`` (only when asked for) ``new`` with selective checkpointing: each layer's
           matmul and attention outputs kept, the rest recomputed (`=selective`).
* ``hf``   the Hugging Face forward (SDPA attention, its own mask from the [B, L] padding mask)
           with ``logits_to_keep``, then TRL's ``selective_log_softmax`` over the full logits
           and its ``entropy_from_logits`` under no_grad (what TRL's GRPO trainer does).

The model is SmolLM2-135M's architecture (llama: hidden 576, 9 heads, 3 kv heads, head_dim
64, intermediate 1536, vocab 49152, tied embeddings), random init, float32, on CPU;
``--layers`` of its 30 decoder layers (4 by default: the LM head and attention, what this
benchmark is about, do not depend on the depth; the per-layer activations scale with it).

Each (forward, length) runs in a fresh subprocess: the model and its gradient buffers are
built, the peak-RSS counter is reset (``/proc/self/clear_refs``), the step runs, and the peak
RSS above the model and its gradients is what is reported. Time: the step's wall time (the
fastest of ``--repeats``).

    OMP_NUM_THREADS=2 python benchmarks/memory_vs_length.py --out benchmarks/results/memory_vs_length.md
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (64, 128, 256, 512, 1024)
METHODS = ("old", "new", "hf")  # the table's columns
EXTRA_METHODS = ("new+ckpt", "new+selective")  # measured when --methods names them, shown in a table of their own
PROMPTS, GROUP, PROMPT_LEN = 2, 8, 64


def smollm2_config(layers: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=None)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def load_old_grouped_forward(rev: str = "HEAD"):
    """The grouped forward of ``rev`` (git), as a module of its own."""
    source = subprocess.run(["git", "show", f"{rev}:src/posttrain/models/grouped_forward.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_grouped_forward.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_grouped_forward", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def measure_one(method: str, length: int, layers: int, repeats: int, old_rev: str, bf16: bool = False) -> dict:
    """One configuration, in this process (run it in a fresh one)."""
    import torch
    import transformers

    from posttrain import core
    from posttrain.distributed.recompute import enable_activation_checkpointing
    from posttrain.models.forward import sequence_logprobs

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(smollm2_config(layers)).train()
    assert model.config._attn_implementation == "sdpa"
    if method in ("new+ckpt", "new+selective"):
        enable_activation_checkpointing(model, "selective" if method == "new+selective" else True)
    for p in model.parameters():  # gradient buffers are part of the baseline
        p.grad = torch.zeros_like(p)
    batch = PROMPTS * GROUP
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(1, 49152, (PROMPTS, PROMPT_LEN), generator=g).repeat_interleave(GROUP, 0)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[GROUP:, :3] = 0  # the second prompt is 3 tokens shorter (left padding)
    response_ids = torch.randint(1, 49152, (batch, length), generator=g)
    response_mask = torch.ones(batch, length)
    advantages = torch.randn(batch, 1, generator=g)
    old = load_old_grouped_forward(old_rev) if method == "old" else None
    if method == "hf":
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    def step():
        if method.startswith("new"):
            logp, _ = sequence_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask,
                                        with_entropy=True, entropy_grad=False)
        elif method == "old":
            logits = old.grouped_logits(model, prompt_ids, prompt_mask, response_ids, response_mask, GROUP)
            logp, _ = core.token_logprobs_and_entropy(logits, response_ids, with_entropy=True, entropy_grad=False)
        else:
            input_ids = torch.cat([prompt_ids, response_ids], dim=1)
            attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
            position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
            logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False, logits_to_keep=length + 1).logits[:, :-1]
            logp = selective_log_softmax(logits, response_ids)
            with torch.no_grad():
                entropy_from_logits(logits)
        loss = -(logp * advantages * response_mask).sum() / response_mask.sum()
        loss.backward()

    import gc

    seconds, peak_mb = [], None
    for index in range(repeats):
        gc.collect()
        base_kb = _status_kb("VmRSS")
        reset = _reset_peak()
        started = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):  # --bf16: bf16-mixed, as Lightning runs it
            step()
        seconds.append(time.perf_counter() - started)
        if index == 0:
            peak_mb = (_status_kb("VmHWM") - base_kb) / 1024  # without the reset: the process's whole peak
    return {"method": method, "length": length, "layers": layers, "peak_mb": peak_mb, "seconds": min(seconds),
            "threads": torch.get_num_threads(), "peak_reset": reset, "bf16": bf16}


def run_one(method: str, length: int, layers: int, repeats: int, old_rev: str, bf16: bool = False) -> dict:
    """One configuration in a fresh subprocess; a run the kernel kills (out of memory) is a row
    with ``oom`` set and no numbers."""
    cmd = [sys.executable, __file__, "--one", method, str(length), "--layers", str(layers),
           "--repeats", str(repeats if length <= 256 else 1), "--old-rev", old_rev] + (["--bf16"] if bf16 else [])
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode == -9:  # SIGKILL: the OOM killer
        return {"method": method, "length": length, "layers": layers, "peak_mb": None, "seconds": None, "oom": True}
    if done.returncode != 0:
        raise RuntimeError(f"{method} T={length} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_all(lengths, methods, layers, repeats, old_rev, store: Path | None = None, resume: bool = False,
            bf16: bool = False) -> list[dict]:
    """Every (length, method), each row appended to ``store`` (JSON) as it is measured; with
    ``resume`` the rows already there (same layers) are kept, not measured again."""
    rows = json.loads(store.read_text()) if resume and store is not None and store.exists() else []
    have = {(r["method"], r["length"], r["layers"]) for r in rows}
    for length in lengths:
        for method in methods:
            if (method, length, layers) in have:
                continue
            row = run_one(method, length, layers, repeats, old_rev, bf16)
            shown = "out of memory" if row.get("oom") else f"{row['peak_mb']:8.0f} MB  {row['seconds']:7.2f} s"
            print(f"  {method:>13} T={length:5d}: {shown}", flush=True)
            rows.append(row)
            if store is not None:
                store.parent.mkdir(parents=True, exist_ok=True)
                store.write_text(json.dumps(rows, indent=1))
    return [r for r in rows if r["layers"] == layers and r["length"] in lengths and r["method"] in methods]


def _ratio(a, b, digits=2) -> str:
    return "-" if a is None or b is None else f"{a / b:.{digits}f}"


def _cell(x, fmt) -> str:
    return "OOM" if x is None else format(x, fmt)


def table(rows, lengths) -> str:
    by = {(r["method"], r["length"]): r for r in rows}
    header = ("| response tokens | old MB | new MB | HF+TRL MB | new/old | new/HF | old s | new s | HF s "
              "| new/old time | new/HF time |")
    lines = [header, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in lengths:
        o, w, h = by[("old", n)], by[("new", n)], by[("hf", n)]
        lines.append(f"| {n} | {_cell(o['peak_mb'], '.0f')} | {_cell(w['peak_mb'], '.0f')} | "
                     f"{_cell(h['peak_mb'], '.0f')} | {_ratio(w['peak_mb'], o['peak_mb'])} | "
                     f"{_ratio(w['peak_mb'], h['peak_mb'])} | {_cell(o['seconds'], '.1f')} | "
                     f"{_cell(w['seconds'], '.1f')} | {_cell(h['seconds'], '.1f')} | "
                     f"{_ratio(w['seconds'], o['seconds'])} | {_ratio(w['seconds'], h['seconds'])} |")
    return "\n".join(lines)


def extra_table(rows, lengths) -> str:
    """The `EXTRA_METHODS` rows measured, against ``new``."""
    by = {(r["method"], r["length"]): r for r in rows}
    lines = []
    for method in EXTRA_METHODS:
        if not any((method, n) in by for n in lengths):
            continue
        lines += [f"| response tokens | {method} MB | {method}/new MB | {method} s | {method}/new time |",
                  "|---:|---:|---:|---:|---:|"]
        for n in lengths:
            x, w = by[(method, n)], by[("new", n)]
            lines.append(f"| {n} | {_cell(x['peak_mb'], '.0f')} | {_ratio(x['peak_mb'], w['peak_mb'])} | "
                         f"{_cell(x['seconds'], '.1f')} | {_ratio(x['seconds'], w['seconds'])} |")
    return "\n".join(lines)


def slopes(rows, lengths) -> str:
    """MB per added response token (of each of the 16 rows) between consecutive lengths."""
    by = {(r["method"], r["length"]): r["peak_mb"] for r in rows}
    steps = list(itertools.pairwise(lengths))
    lines = ["| method | " + " | ".join(f"{a}->{b}" for a, b in steps) + " |",
             "|---|" + "---:|" * len(steps)]
    for method in METHODS + tuple(m for m in EXTRA_METHODS if any(r["method"] == m for r in rows)):
        cells = []
        for a, b in steps:
            low, high = by.get((method, a)), by.get((method, b))
            cells.append("-" if low is None or high is None else f"{(high - low) / (b - a):.2f}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "LENGTH"), help=argparse.SUPPRESS)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS + EXTRA_METHODS)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="steps per configuration up to 256 tokens (1 above)")
    parser.add_argument("--old-rev", default="HEAD", help="git revision of the old grouped forward")
    parser.add_argument("--out", type=Path, help="write the markdown results here (and the rows to <out>.json)")
    parser.add_argument("--resume", action="store_true", help="keep the rows already in <out>.json")
    parser.add_argument("--bf16", action="store_true", help="the step under CPU bf16 autocast (default fp32)")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.one[0], int(args.one[1]), args.layers, args.repeats, args.old_rev, args.bf16)))
        return None
    started = time.perf_counter()
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(f"SmolLM2-135M architecture, {args.layers} layers, {PROMPTS}x{GROUP} responses, prompt {PROMPT_LEN} "
          f"tokens, {'bf16-mixed' if args.bf16 else 'fp32'}, OMP_NUM_THREADS={threads}", flush=True)
    store = args.out.with_suffix(".json") if args.out else None
    rows = run_all(args.lengths, args.methods, args.layers, args.repeats, args.old_rev, store, args.resume, args.bf16)
    full = set(METHODS) <= set(args.methods)
    text = table(rows, args.lengths) if full else json.dumps(rows, indent=1)
    if full and set(args.methods) - set(METHODS):
        text += "\n\n" + extra_table(rows, args.lengths)
    slope = slopes(rows, args.lengths) if full else ""
    print(text)
    print(slope)
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.out and full:
        command = f"OMP_NUM_THREADS={threads} python benchmarks/memory_vs_length.py " + \
            " ".join(argv if argv is not None else sys.argv[1:])
        args.out.write_text(f"# Memory and time vs response length (issue 27)\n\n"
                            f"Date: {datetime.date.today().isoformat()}\n\nCommand: `{command}`\n\n"
                            f"Setup: {__doc__.split(chr(10) + chr(10))[1]}\n\n"
                            f"Peak RSS above the model and its gradient buffers (MB), and the step's wall time "
                            f"(s), {args.layers} of 30 layers (OOM: killed by the kernel's OOM killer):\n\n"
                            f"{text}\n\nSlope: MB per added response token (per row, 16 rows):\n\n{slope}\n\n"
                            f"Rows: `{store.name}`.\n")
    return rows


if __name__ == "__main__":
    main()
