"""Pretraining text for PPO-ptx (`algorithm.ptx_data`, InstructGPT's ptx term).

`algorithm.ptx_data` names where the documents come from:

    a .jsonl file      one JSON object a line, its "text" field a document
    any other file     one document a line (blank lines skipped)
    a hub dataset      ``name`` or ``name:config`` (e.g. ``wikitext:wikitext-2-raw-v1``): the
                       "text" column of its train split, read with `datasets` where a hub is reachable

The documents are tokenised once, joined end to end with an EOS after each, and cut into
chunks of `seq_len` tokens (the tail shorter than a chunk is dropped). Chunk ``i`` is a pure
function of the text, the tokenizer and `seq_len`, so the chunks behave as a finite task
source of one split: `ExampleCursor` reads them in a seeded order reshuffled each pass, each
rank its own disjoint share, and its position is what a resume restores.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from posttrain.data.sources import json_lines
from posttrain.errors import ConfigError, DataError

log = logging.getLogger(__name__)

KEY = "algorithm.ptx_data"
TEXT_FIELD = "text"
# Above this share of unknown tokens the text mostly falls outside the tokenizer's vocabulary
# (English text for the embedded model, whose tokenizer has only the task's characters).
UNKNOWN_WARNING_SHARE = 0.1


# A name with one of these endings is a file, never a hub dataset.
FILE_SUFFIXES = (".txt", ".text", ".md", ".jsonl", ".json", ".csv")


def names_a_file(name: str) -> bool:
    """Whether ``algorithm.ptx_data`` names a local file (else a hub dataset): an existing
    path, an absolute or ./ ~ path, or a name with a file's ending."""
    path = Path(name).expanduser()
    return path.exists() or path.is_absolute() or name.startswith((".", "~")) or path.suffix.lower() in FILE_SUFFIXES


def read_documents(name: str) -> list[str]:
    """The documents named by ``algorithm.ptx_data`` (see the module docstring)."""
    if not names_a_file(name):
        return read_hub_texts(name)
    path = Path(name).expanduser()
    if not path.is_file():
        raise DataError(f"{KEY}={name!r}: no such file (a text file with a document a line, or a .jsonl file "
                        f"with a {TEXT_FIELD!r} field)")
    return read_jsonl_texts(path) if path.suffix.lower() == ".jsonl" else read_text_lines(path)


def read_text_lines(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(f"{KEY}={str(path)!r}: byte {err.start} is not valid UTF-8 ({err.reason}); "
                        f"pretraining text must be UTF-8") from None
    documents = [line for line in lines if line.strip()]
    if not documents:
        raise DataError(f"{KEY}={str(path)!r} holds no text")
    return documents


def read_jsonl_texts(path: Path) -> list[str]:
    documents = []
    for where, _, record in json_lines(path, KEY):
        if not isinstance(record, dict) or not isinstance(record.get(TEXT_FIELD), str):
            raise DataError(f"{where} needs a string field {TEXT_FIELD!r}")
        if record[TEXT_FIELD].strip():
            documents.append(record[TEXT_FIELD])
    if not documents:
        raise DataError(f"{KEY}={str(path)!r} holds no text")
    return documents


def read_hub_texts(name: str) -> list[str]:
    # start-up: `datasets` loads only for hub data
    import datasets

    dataset, _, config = name.partition(":")
    try:
        table = datasets.load_dataset(dataset, config or None, split="train")
    except Exception as err:  # noqa: BLE001 - no network, unknown name, unknown config: all one message
        raise DataError(f"{KEY}={name!r} could not be loaded from the Hugging Face hub: {type(err).__name__}: "
                        f"{(str(err).strip().splitlines() or [''])[0]}. Without network, write the text to a local "
                        f"file (one document a line, or a .jsonl with a {TEXT_FIELD!r} field) and name that file")
    if TEXT_FIELD not in table.column_names:
        raise DataError(f"{KEY}={name!r} has no {TEXT_FIELD!r} column; its columns are {table.column_names}")
    return [text for text in table[TEXT_FIELD] if text and text.strip()]


class PretrainingChunks:
    """The documents as consecutive chunks of `seq_len` token ids (EOS after each document):
    a source of one split, "train", for `ExampleCursor`; `example(split, i)` is chunk i [seq_len]."""

    def __init__(self, documents: list[str], tokenizer, seq_len: int, context: int | None = None):
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2:
            raise ConfigError(f"algorithm.ptx_seq_len={seq_len!r} must be an integer >= 2 (tokens per chunk)")
        if context is not None and seq_len > context:
            raise ConfigError(f"algorithm.ptx_seq_len={seq_len} is longer than the model's context of {context} "
                              f"tokens; lower it")
        ids: list[int] = []
        for row in tokenizer(documents, add_special_tokens=False)["input_ids"]:
            ids += row + [tokenizer.eos_token_id]
        count = len(ids) // seq_len
        if count == 0:
            raise DataError(f"{KEY}: the text is {len(ids)} tokens, less than one chunk of algorithm.ptx_seq_len="
                            f"{seq_len}; give more text or lower algorithm.ptx_seq_len")
        self.chunks = torch.tensor(ids[:count * seq_len], dtype=torch.long).view(count, seq_len)
        unknown = tokenizer.unk_token_id
        if unknown is not None:
            share = float((self.chunks == unknown).float().mean())
            if share > UNKNOWN_WARNING_SHARE:
                log.warning(f"{KEY}: {share:.0%} of the pretraining tokens are unknown to the tokenizer "
                            f"({tokenizer.unk_token}); the text is mostly outside its vocabulary")

    def size(self, split: str) -> int:
        return len(self.chunks)

    def example(self, split: str, index: int) -> torch.Tensor:
        return self.chunks[index]
