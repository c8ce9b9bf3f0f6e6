"""`posttrain-estimate <overrides>`: the estimate printed as tables, or as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console
from rich.table import Table

from posttrain.errors import ConfigError, PosttrainError
from posttrain.estimate.estimator import Estimate, composed_config, estimate
from posttrain.estimate.memory import size as in_units
from posttrain.estimate.speed import CPU_DEVICE, GPU_SPECS

PROGRAM = "posttrain-estimate"


def size(n: float) -> str:
    return in_units(n) if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def render(result: Estimate) -> None:
    """The estimate as tables on the console."""
    console = Console()
    b = result.batch
    console.print(f"[bold]{result.model}[/bold]: {result.shape['layers']} layers, hidden {result.shape['hidden']}, "
                  f"vocab {result.shape['vocab']}; per device: {b['rows']} rows ({b['prompts']} prompts) of "
                  f"{b['prompt_tokens']} prompt + {b['response_tokens']} response tokens, micro-batch "
                  f"{b['micro_rows']} rows x {b['micro_batches']}, {b['optimiser_steps']} optimiser step(s) per batch")
    roles = Table(title="parameters per role (per device)")
    for column in ("role", "model", "parameters", "bytes / parameter", "trainable"):
        roles.add_column(column)
    for r in result.roles:
        roles.add_row(r["role"], r["model"], f"{r['parameters']:,}", f"{r['bytes_per_parameter']:g}",
                      "yes" if r["trainable"] else "no")
    console.print(roles)
    mode = {False: "off", True: "on"}.get(result.checkpointing, result.checkpointing)
    memory = Table(title=f"memory per device by stage (activation checkpointing {mode})")
    memory.add_column("term")
    stages = list(result.memory)
    for stage in stages:
        memory.add_column(stage, justify="right")
    terms = list(dict.fromkeys(t for stage in stages for t in result.memory[stage]))
    for term in terms:
        memory.add_row(term, *(size(result.memory[s][term]) if term in result.memory[s] else "" for s in stages))
    memory.add_row("[bold]total[/bold]", *(f"[bold]{size(result.peak[s])}[/bold]" for s in stages))
    console.print(memory)
    console.print(f"peak: [bold]{size(result.peak['peak'])}[/bold]; the update's activations "
                  f"{size(result.activations['without checkpointing'])} without checkpointing, "
                  f"{size(result.activations['with checkpointing'])} with, "
                  f"{size(result.activations['with selective checkpointing'])} with selective")
    timing = Table(title="FLOPs per rollout batch and lower bounds on seconds (spec peaks for GPUs)")
    timing.add_column("stage")
    timing.add_column("FLOPs", justify="right")
    for device in result.seconds:
        timing.add_column(f"{device} s", justify="right")
    for stage in [*result.flops, "step"]:
        flops = f"{result.flops[stage]:.3g}" if stage in result.flops else f"{sum(result.flops.values()):.3g}"
        timing.add_row(stage, flops, *(f"{result.seconds[d][stage]:.3g}" for d in result.seconds))
    console.print(timing)
    for note in result.notes:
        console.print(f"note: {note}")


def parse_arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog=PROGRAM, description="What a run costs, from its config alone: "
                                     "memory per device by stage, FLOPs and lower bounds on seconds per step.",
                                     epilog="Other arguments are the run's Hydra overrides, as given to posttrain.")
    parser.add_argument("--device", help=f"bound the seconds on this device only: {CPU_DEVICE} (measured) or "
                                         f"{', '.join(GPU_SPECS)} (spec peaks)")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    parser.add_argument("--prompt-tokens", type=int, help="the prompt width (default: the data's longest prompt)")
    parser.add_argument("--response-tokens", type=int, help="the response length (default: the generation budget)")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> None:
    args, overrides = parse_arguments(sys.argv[1:] if argv is None else argv)
    try:
        unknown = [a for a in overrides if a.startswith("-")]
        if unknown:
            raise ConfigError(f"unknown option(s) {unknown}; see {PROGRAM} --help")
        cfg = composed_config(overrides)
        result = estimate(cfg, args.prompt_tokens, args.response_tokens, args.device)
    except (PosttrainError, OmegaConfBaseException, HydraException) as err:
        print(f"{PROGRAM}: error: {err}", file=sys.stderr)
        sys.exit(1)
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        render(result)


if __name__ == "__main__":
    main()
