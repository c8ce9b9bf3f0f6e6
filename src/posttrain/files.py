"""Small run utilities: the config tree, atomic file writes, run names."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON to a temporary file beside `path`, then rename: never a half-written file.

    The file gets the mode of any other output (0666 less the umask, e.g. 0644): mkstemp's
    private 0600 would hide summaries from the rest of a group sharing the run directory.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:  # a fresh name (O_EXCL), like mkstemp, but created with the umask's mode
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. data that is not JSON-serialisable: leave no stray file
        raise


def save_pretrained_atomic(model, tokenizer, directory: Path, subdirectories: dict | None = None) -> None:
    """Hugging Face export (model + tokenizer) through a temporary directory and a rename;
    `subdirectories`: further models saved inside it by name (a LoRA adapter beside its merged model)."""
    tmp = directory.with_name(f".{directory.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for name, part in (subdirectories or {}).items():
            part.save_pretrained(tmp / name)
        # transformers writes model.safetensors through a private (0600) temporary file: give
        # every file the mode a new file normally gets here, so the group can read the export
        mode = _new_file_mode(tmp)
        for file in tmp.rglob("*"):
            if file.is_file():
                os.chmod(file, stat.S_IMODE(file.stat().st_mode) | mode)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed export leaves no half-written directory
        raise
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)


def save_config_atomic(cfg: DictConfig, path: Path) -> None:
    """The resolved config as YAML, written to a temporary file and renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    OmegaConf.save(cfg, tmp, resolve=True)
    os.replace(tmp, path)


def _new_file_mode(directory: Path) -> int:
    """The permission bits a new file gets in ``directory`` (0666 less the umask), read off a
    probe file: asking os.umask would change the whole process's umask for a moment."""
    probe = directory / f".mode-probe.{os.getpid()}.{secrets.token_hex(4)}"
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        return stat.S_IMODE(probe.stat().st_mode)
    finally:
        probe.unlink()


def write_jsonl_atomic(path: Path, rows: list[dict]) -> None:
    """One JSON object a line, written whole or not at all (a temporary file, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(partial, path)
