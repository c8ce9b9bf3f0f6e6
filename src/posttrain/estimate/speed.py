"""How fast a device runs: this CPU's best reading of a short matmul and copy benchmark (kept
under paths.cache_dir), a GPU kind from its vendor's spec sheet."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from posttrain.errors import ConfigError
from posttrain.estimate.stages import activation_dtype_bytes
from posttrain.files import write_json_atomic

# bf16 dense tensor FLOP/s (no sparsity) and memory bandwidth, from the vendors' spec sheets:
# peaks no run reaches, so the seconds derived from them are lower bounds.
GPU_SPECS = {
    "h100": {"name": "NVIDIA H100 SXM", "flops": 989e12, "bandwidth": 3.35e12},
    "h200": {"name": "NVIDIA H200 SXM", "flops": 989e12, "bandwidth": 4.8e12},
    "a100": {"name": "NVIDIA A100 SXM 80GB", "flops": 312e12, "bandwidth": 2.039e12},
    "l4": {"name": "NVIDIA L4", "flops": 121e12, "bandwidth": 0.3e12},
}
CPU_DEVICE = "cpu"


def cpu_speed(cache_dir: Path, dtype: torch.dtype = torch.float32) -> dict:
    """This CPU's matmul FLOP/s in `dtype` (the run's compute dtype: a CPU with bf16 instructions
    multiplies bf16 faster than fp32, and a bound from the fp32 speed would not bound a bf16 run)
    and copy bandwidth at torch's thread count: the best reading so far, kept in
    `cache_dir`/estimate/ by processor, threads, dtype and torch. Each call measures again (about
    half a second) and keeps, per figure, the higher of that reading and the kept one: a machine
    busy with other jobs reads too low a speed (39 GFLOP/s against 195 idle here), whose bound
    would exceed real steps, and such a reading never replaces a better one."""
    threads = torch.get_num_threads()
    key = f"{processor_name()}|{threads}|{dtype}|{torch.__version__}"
    cache = Path(cache_dir) / "estimate" / "cpu_speed.json"
    cached = json.loads(cache.read_text()) if cache.is_file() else {}
    reading = measure_cpu(threads, dtype)
    kept = cached.get(key, reading)
    best = {**reading, **{figure: max(kept[figure], reading[figure]) for figure in ("flops", "bandwidth")}}
    if best != cached.get(key):
        cached[key] = best
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(cache, cached)
    return best


def measure_cpu(threads: int, dtype: torch.dtype = torch.float32, size: int = 1024,
                copy_elements: int = 1 << 25) -> dict:
    """The best of a few timed `dtype` matmuls and fp32 tensor copies."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    src = torch.ones(copy_elements)
    dst = torch.empty_like(src)
    a @ b, dst.copy_(src)  # warm-up
    matmul = copy = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        a @ b
        matmul = min(matmul, time.perf_counter() - started)
        started = time.perf_counter()
        dst.copy_(src)
        copy = min(copy, time.perf_counter() - started)
    return {"name": f"this CPU ({processor_name()}, {threads} threads, measured {str(dtype).removeprefix('torch.')})",
            "flops": 2 * size**3 / matmul, "bandwidth": 2 * 4 * copy_elements / copy}


def processor_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_speeds(cfg, device: str | None) -> dict[str, dict]:
    """The devices to bound the seconds on: `device` alone, or this CPU and every GPU kind."""
    if device is not None and device != CPU_DEVICE and device not in GPU_SPECS:
        raise ConfigError(f"--device={device!r} is not a device the estimate knows; use {CPU_DEVICE} or one of "
                          f"{', '.join(GPU_SPECS)}")
    names = [device] if device is not None else [CPU_DEVICE, *GPU_SPECS]
    dtype = torch.bfloat16 if activation_dtype_bytes(cfg) == 2 else torch.float32  # the matmuls' dtype
    return {name: cpu_speed(Path(cfg.paths.cache_dir), dtype) if name == CPU_DEVICE else GPU_SPECS[name]
            for name in names}
