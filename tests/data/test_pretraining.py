"""PPO-ptx's pretraining text (data/pretraining.py): reading the documents, cutting them into
chunks, and the resumable, per-rank stream over the chunks."""

import json

import pytest

from posttrain.data.arithmetic import ALPHABET
from posttrain.data.datamodule import ExampleCursor
from posttrain.data.pretraining import PretrainingChunks, names_a_file, read_documents
from posttrain.errors import ConfigError, DataError
from posttrain.models.tiny import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(ALPHABET)


def test_documents_are_lines_of_a_text_file_or_the_text_of_a_jsonl(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("12+3=15\n\n  \n4+5=9\n")
    assert read_documents(str(text)) == ["12+3=15", "4+5=9"]  # blank lines are no documents
    records = tmp_path / "corpus.jsonl"
    records.write_text(json.dumps({"text": "1+1=2", "id": 0}) + "\n\n" + json.dumps({"text": "2+2=4"}) + "\n")
    assert read_documents(str(records)) == ["1+1=2", "2+2=4"]


def test_bad_pretraining_text_is_a_data_error_naming_the_file(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_documents(str(tmp_path / "missing.txt"))
    records = tmp_path / "corpus.jsonl"
    records.write_text(json.dumps({"body": "1+1=2"}) + "\n")
    with pytest.raises(DataError, match=r"corpus.jsonl:1 .*'text'"):
        read_documents(str(records))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="holds no text"):
        read_documents(str(empty))
    # a name without a file's ending and no such path is a hub dataset, not a file
    assert not names_a_file("wikitext:wikitext-2-raw-v1") and names_a_file("corpus.txt")


def test_documents_are_joined_by_eos_and_cut_into_chunks(tokenizer):
    chunks = PretrainingChunks(["1+2", "34", "5=6"], tokenizer, seq_len=4)
    ids = {c: tokenizer.convert_tokens_to_ids(c) for c in "123456+="}
    eos = tokenizer.eos_token_id
    # 1 + 2 <eos> 3 4 <eos> 5 = 6 <eos>: 11 tokens, two chunks of 4, the last 3 dropped
    assert chunks.size("train") == 2
    assert chunks.example("train", 0).tolist() == [ids["1"], ids["+"], ids["2"], eos]
    assert chunks.example("train", 1).tolist() == [ids["3"], ids["4"], eos, ids["5"]]
    with pytest.raises(DataError, match="less than one chunk"):
        PretrainingChunks(["12"], tokenizer, seq_len=4)
    with pytest.raises(ConfigError, match="longer than the model's context"):
        PretrainingChunks(["1+2"], tokenizer, seq_len=4, context=3)


def test_ranks_read_disjoint_chunks_and_a_cursor_resumes_where_it_stood(tokenizer):
    chunks = PretrainingChunks([f"{i}+{i}={2 * i}" for i in range(40)], tokenizer, seq_len=8)
    count = chunks.size("train")
    ranks = [ExampleCursor(chunks, "train", seed=1, rank=r, world_size=2) for r in (0, 1)]
    seen = [set(cursor.take_indices(count // 2)) for cursor in ranks]
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 2 * (count // 2)  # one pass, split between them
    resumed = ExampleCursor(chunks, "train", seed=1, rank=0, world_size=2, position=ranks[0].position)
    assert [c.tolist() for c in resumed.take(3)] == [c.tolist() for c in ranks[0].take(3)]
