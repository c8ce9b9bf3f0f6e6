"""bf16 on the CPU, where the CPU multiplies bf16 itself.

Under `trainer.precision=bf16-mixed` Lightning runs each step in `torch.autocast("cpu",
torch.bfloat16)`: the weights stay fp32 (AdamW steps them), the matmuls and their activations are
bf16. A CPU with native bf16 dot products (x86 AVX512-BF16 or AMX, ARM's BF16 extension) runs those
matmuls about twice as fast as fp32 (1.97x a SmolLM2 GRPO step here, docs/results.md); one without
them emulates bf16 by converting around each product, with no speed to gain for the precision
lost (not measured here: this machine has AVX512-BF16). So a bf16-mixed run whose trainer is the
CPU falls back to 32-true there, saying so (`trainer=cpu_bf16`, docs/running.md "bf16 on the CPU").
"""

from __future__ import annotations

from pathlib import Path

FP32 = "32-true"  # Lightning's name for fp32 training: the fallback, and what goes unsaid
CPUINFO = Path("/proc/cpuinfo")  # ARM: the "bf16" feature flag (Neoverse V1/N2, Graviton 3 on)


def native_cpu_bf16() -> str | None:
    """The feature by which this CPU multiplies bf16 natively, or None."""
    import torch  # start-up: torch loads once Hydra has composed the command line

    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return "AVX512-BF16"
    if CPUINFO.exists():
        for line in CPUINFO.read_text().splitlines():
            if line.startswith("Features") and "bf16" in line.split(":", 1)[-1].split():
                return "ARM BF16"
    return None


def trains_on_cpu(accelerator: str) -> bool:
    """Whether Lightning's `accelerator` resolves to the CPU on this machine."""
    import torch  # start-up: torch loads once Hydra has composed the command line

    return accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())


def cpu_precision(precision: str, accelerator: str) -> tuple[str, str | None]:
    """(the precision to train in, a line saying why it changed or None). Only bf16-mixed on a
    CPU without native bf16 changes (to 32-true); every other setting is kept as it is."""
    if precision != "bf16-mixed" or not trains_on_cpu(accelerator):
        return precision, None
    if native_cpu_bf16() is not None:
        return precision, None
    return FP32, (f"trainer.precision=bf16-mixed: this CPU has no native bf16 (neither AVX512-BF16 nor AMX, "
                      f"nor ARM's BF16), where bf16 matmuls are emulated, with no speed to gain: training in "
                      f"{FP32} instead")
