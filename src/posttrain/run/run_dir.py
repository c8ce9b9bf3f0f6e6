"""What a path names in a run's world: a run directory, a Lightning checkpoint, a Hugging Face
model or LoRA adapter directory; and the clean-up of a run directory that a failed job left
with nothing of its own in it."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from posttrain.errors import CheckpointError, ConfigError

USAGE = "posttrain-eval checkpoint=<run dir | .ckpt file | Hugging Face model dir>"


@dataclass
class Weights:
    path: Path              # a Lightning checkpoint file, a Hugging Face model or LoRA adapter directory
    is_hf_dir: bool         # a model or adapter directory (it carries its tokenizer)
    run_dir: Path | None    # the training run they came from (it has config.yaml), if any


def is_run_dir(path: Path) -> bool:
    return (path / "config.yaml").is_file()


def is_adapter_dir(path: Path) -> bool:
    from posttrain.models.lora import ADAPTER_CONFIG  # start-up: torch loads only once the arguments are checked

    return (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() or is_adapter_dir(path)


def load_from_adapter(model_cfg: DictConfig, directory: Path) -> None:
    """Evaluate a LoRA adapter export: its base (recorded by PEFT in adapter_config.json) under
    an adapter of the recorded shape, the export's weights loaded onto it."""
    from posttrain.models.lora import ADAPTER_CONFIG  # start-up: as above

    adapter = json.loads((directory / ADAPTER_CONFIG).read_text())
    if not adapter.get("base_model_name_or_path"):
        raise CheckpointError(f"{directory} is a LoRA adapter without a recorded base model "
                              f"(base_model_name_or_path in {ADAPTER_CONFIG}): evaluate a merged export instead")
    model_cfg.name_or_path, model_cfg.init_from = adapter["base_model_name_or_path"], str(directory)
    model_cfg.lora.r, model_cfg.lora.alpha = adapter["r"], adapter["lora_alpha"]
    targets = adapter["target_modules"]
    model_cfg.lora.target_modules = sorted(targets) if isinstance(targets, (list, set)) else targets


def find_weights(checkpoint: str | None) -> Weights:
    """What `checkpoint=` points at: a run dir (its hf_model/, else checkpoints/last.ckpt), a
    .ckpt file (inside a run's checkpoints/ or not), or an HF dir (a run's hf_model/ or not)."""
    if checkpoint is None:
        raise ConfigError(f"checkpoint is not set: say what to evaluate, e.g. `{USAGE}`")
    path = Path(str(checkpoint)).expanduser().resolve()
    if not path.exists():
        raise CheckpointError(f"checkpoint={checkpoint!r}: no such file or directory ({path}). Usage: {USAGE}")
    if path.is_file():
        in_run = path.parent.name == "checkpoints" and is_run_dir(path.parent.parent)
        return Weights(path, is_hf_dir=False, run_dir=path.parent.parent if in_run else None)
    if is_run_dir(path):
        if is_hf_dir(path / "hf_model"):  # the final model, written when training finished
            return Weights(path / "hf_model", is_hf_dir=True, run_dir=path)
        if (path / "checkpoints" / "last.ckpt").is_file():  # a run that stopped before its export
            return Weights(path / "checkpoints" / "last.ckpt", is_hf_dir=False, run_dir=path)
        raise CheckpointError(f"checkpoint={checkpoint!r} is a run directory without weights: it has neither "
                              f"{path / 'hf_model'} nor {path / 'checkpoints' / 'last.ckpt'} (the run stopped "
                              f"before its first checkpoint). Point checkpoint= at a .ckpt file or a model directory")
    if is_hf_dir(path):
        return Weights(path, is_hf_dir=True, run_dir=path.parent if is_run_dir(path.parent) else None)
    raise CheckpointError(f"checkpoint={checkpoint!r} ({path}) is neither a posttrain run directory (it has no "
                          f"config.yaml) nor a Hugging Face model directory (it has no config.json). Usage: {USAGE}")


def remove_unused_run_dir(output_dir: Path, log_dir: Path, log_name: str = "train.log") -> None:
    """A run that failed before writing anything of its own leaves no directory behind (nor
    the empty parents Hydra made for it, up to paths.log_dir)."""
    if not output_dir.is_dir() or any(p.name not in (".hydra", log_name) for p in output_dir.iterdir()):
        return
    shutil.rmtree(output_dir, ignore_errors=True)
    log_dir = log_dir.resolve()
    for parent in output_dir.resolve().parents:
        if parent == log_dir or log_dir not in parent.parents or any(parent.iterdir()):
            break
        parent.rmdir()
