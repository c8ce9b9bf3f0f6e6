"""Which checkpoint a run resumes from, and whether it can: refused before anything is
built when another algorithm wrote it or its weights have other shapes."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from posttrain.errors import CheckpointError


def resolve_ckpt_path(ckpt_path: str | None, output_dir: Path) -> str | None:
    if ckpt_path is None:
        return None
    path = output_dir / "checkpoints" / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"ckpt_path={ckpt_path!r}: no checkpoint file at {path}")
    return str(path)


def check_checkpoint_algorithm(ckpt_path: str, cfg: DictConfig) -> dict:
    """Refuse, before anything is built, a checkpoint written by another algorithm; returns
    the shapes of its weights for `check_checkpoint_shapes`. (Memory-mapped: cheap to read.)"""
    import torch

    checkpoint = torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=False)
    written_by = checkpoint.get("callbacks", {}).get("RunRecord", {}).get("algorithm")
    if written_by is not None and written_by != cfg.algorithm.name:
        raise CheckpointError(f"ckpt_path={ckpt_path} was written by algorithm={written_by}, but this run is "
                              f"algorithm={cfg.algorithm.name}; resume it as it was started with "
                              f"`posttrain resume=<its run dir>`, or start from its weights with "
                              f"model.init_from={ckpt_path}")
    return {k: v.shape for k, v in checkpoint["state_dict"].items()}


def check_checkpoint_shapes(ckpt_path: str, stored: dict, module) -> None:
    """Refuse weights of another shape than this run's model (the run was started with other
    overrides: `posttrain resume=<run dir>` replays them) before Lightning fails on them."""
    frozen = tuple(f"{role}." for role in getattr(module, "frozen_roles", list)())
    expected = {k: v.shape for k, v in module.state_dict().items() if not k.startswith(frozen)}
    for key in sorted(expected.keys() | stored.keys()):
        if expected.get(key) != stored.get(key):
            describe = lambda shape: "absent" if shape is None else f"of shape {tuple(shape)}"  # noqa: E731
            raise CheckpointError(f"ckpt_path={ckpt_path} does not fit this run's model: {key} is "
                                  f"{describe(stored.get(key))} there and {describe(expected.get(key))} here. "
                                  f"Resume a run with the overrides it was started with: "
                                  f"`posttrain resume=<its run dir>`")
