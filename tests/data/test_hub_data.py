"""Datasets-backed sources (data=gsm8k, math, prompt_answer) on local files shaped exactly
like the real datasets, prompt templates, chat rendering with real tokenizer formats, and a
tiny end-to-end GRPO run on GSM8K-shaped data."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from posttrain.data.datamodule import collate_sft, prompt_text, prompt_token_ids
from posttrain.data.examples import Example
from posttrain.data.sources import JsonlSource, build_source
from posttrain.errors import ConfigError, DataError
from posttrain.run.history import HISTORY_FILE, read_history
from posttrain.rewards.base import ScoredSample
from posttrain.rewards.components import AccuracyReward
from posttrain.rewards.composite import CompositeReward

from conftest import FAST_RUN, compose_config
from hf_models import write_jsonl
from test_answers import hang_on_marked_answer

GSM8K_SOLUTION = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                  "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


def gsm8k_row(i: int) -> dict:
    return {"question": f"Natalia sold clips to {48 + i} of her friends in April, and then she sold half as "
                        f"many clips in May. How many clips did Natalia sell altogether in April and May?",
            "answer": GSM8K_SOLUTION.replace("72", str(72 + i)) if i else GSM8K_SOLUTION}


def math_row(i: int) -> dict:
    return {"problem": f"What is $\\frac{{{i}}}{{2 \\cdot {i}}}$?", "level": "Level 1", "type": "Algebra",
            "solution": f"We cancel {i} and get $\\boxed{{\\frac{{1}}{{2}}}}$."}


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory):
    """A local copy laid out like a GSM8K download: train.jsonl and test.jsonl."""
    directory = tmp_path_factory.mktemp("gsm8k")
    write_jsonl(directory / "train.jsonl", [gsm8k_row(i) for i in range(12)])
    write_jsonl(directory / "test.jsonl", [gsm8k_row(100 + i) for i in range(4)])
    return directory


@pytest.fixture(scope="module")
def math_dir(tmp_path_factory):
    """Parquet shards under a config subdirectory, as hub datasets store them."""
    directory = tmp_path_factory.mktemp("math")
    (directory / "default").mkdir()
    for split, rows in (("train", range(1, 9)), ("test", range(20, 23))):
        table = pa.Table.from_pylist([math_row(i) for i in rows])
        pq.write_table(table, directory / "default" / f"{split}-00000-of-00001.parquet")
    return directory


def source_for(*overrides):
    return build_source(compose_config(list(overrides)).data)


def gsm8k_source(directory, *overrides):
    """GSM8K-shaped data with 3 of its 12 training rows held out (the default 256 is for real data)."""
    return source_for("data=gsm8k", f"data.path={directory}", "data.validation_size=3", *overrides)


def test_gsm8k_local_directory_reads_splits_answers_and_solutions(gsm8k_dir):
    source = gsm8k_source(gsm8k_dir, "data.template=plain", "data.chat=false")
    assert (source.size("train"), source.size("validation"), source.size("test")) == (9, 3, 4)
    test = source.example("test", 0)
    assert test.answer == "172" and test.messages is None
    assert test.prompt == gsm8k_row(100)["question"]  # plain: the question as is
    # the SFT target: the solution without calculator notes, ending with GSM8K's marker
    assert test.response == ("Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 172 clips altogether in "
                             "April and May.\n#### 172")
    assert source.origin("test", 2).endswith("split 'test' row 2")
    assert source.is_correct(test, "48 + 124 = 172\n#### 172.0") and not source.is_correct(test, "#### 171")


def test_templates_shape_prompts_messages_and_targets(gsm8k_dir):
    boxed = gsm8k_source(gsm8k_dir).example("test", 0)
    question = gsm8k_row(100)["question"]
    assert boxed.messages == [{"role": "user", "content": boxed.prompt}]
    assert boxed.prompt.startswith(question) and "\\boxed{}" in boxed.prompt
    assert boxed.response.endswith("The final answer is $\\boxed{172}$.")

    r1 = gsm8k_source(gsm8k_dir, "data.template=r1").example("test", 0)
    assert [m["role"] for m in r1.messages] == ["system", "user"] and r1.messages[1]["content"] == question
    assert "<think>" in r1.messages[0]["content"] and "<answer>" in r1.messages[0]["content"]
    assert r1.response.startswith("<think>\n") and r1.response.endswith("</think>\n<answer>172</answer>")
    r1_text = gsm8k_source(gsm8k_dir, "data.template=r1", "data.chat=false")
    assert r1_text.example("test", 0).prompt.endswith(f"User: {question}\nAssistant:")
    assert r1_text.has_style(r1.response)
    assert not r1_text.has_style("<think>reasoning only</think> 172")
    assert r1_text.is_correct(r1, "<think>171 or 172</think><answer>172</answer>")


def test_validation_is_held_out_of_train_disjoint_and_deterministic(gsm8k_dir):
    overrides = ("data=gsm8k", f"data.path={gsm8k_dir}", "data.validation_size=4")
    first, again = source_for(*overrides), source_for(*overrides)
    other_seed = source_for(*overrides, "data.validation_seed=1")

    def rows(source, split):
        return [source.origin(split, i).split(" (held out")[0] for i in range(source.size(split))]

    validation, train = rows(first, "validation"), rows(first, "train")
    assert len(validation) == 4 and not set(validation) & set(train)
    assert sorted(validation + train) == sorted(f"{gsm8k_dir} split 'train' row {i}" for i in range(12))
    assert rows(again, "validation") == validation and rows(again, "train") == train
    assert rows(other_seed, "validation") != validation
    # the prompts too, not only the bookkeeping
    assert not {e.prompt for e in first.examples["validation"]} & {e.prompt for e in first.examples["train"]}


def test_a_dataset_validation_split_is_used_as_is(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [gsm8k_row(i) for i in range(5)])
    write_jsonl(tmp_path / "validation.jsonl", [gsm8k_row(50 + i) for i in range(2)])
    source = source_for("data=gsm8k", f"data.path={tmp_path}", "data.splits.validation=validation",
                        "data.splits.test=null")
    assert (source.size("train"), source.size("validation")) == (5, 2)
    assert source.example("validation", 1).answer == "123"


def test_math_parquet_takes_the_last_boxed_answer(math_dir):
    source = source_for("data=math", f"data.path={math_dir}", "data.validation_size=2")
    assert (source.size("train"), source.size("validation"), source.size("test")) == (6, 2, 3)
    example = source.example("test", 0)
    assert example.answer == "\\frac{1}{2}"
    assert example.response == math_row(20)["solution"]  # already boxed: the target is the solution
    for response in ("so \\boxed{0.5}", "\\boxed{\\dfrac{1}{2}}", "it is \\boxed{1/2}"):
        assert source.is_correct(example, response), response
    assert not source.is_correct(example, "\\boxed{\\frac{1}{3}}")
    assert source.has_style("\\boxed{0.5}") and not source.has_style("0.5")


def test_prompt_answer_reads_jsonl_and_parquet_with_configured_columns(tmp_path):
    rows = [{"q": f"What is {i} + {i}?", "final": 2 * i, "why": f"{i} + {i} = {2 * i}"} for i in range(6)]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    for name in ("rows.jsonl", "rows.parquet"):
        source = source_for("data=prompt_answer", f"data.path={tmp_path / name}", "data.columns.prompt=q",
                            "data.columns.answer=final", "data.columns.solution=why", "data.validation_size=2")
        assert (source.size("train"), source.size("validation")) == (4, 2)
        example = next(e for e in source.examples["train"] + source.examples["validation"] if e.answer == "10")
        assert example.prompt == "What is 5 + 5?" and example.response == "5 + 5 = 10\n#### 10"
        with pytest.raises(ConfigError, match=r"no split 'test' \(data.splits.test\); its splits are \['train'\]"):
            source.size("test")


def test_a_saved_dataset_dict_and_a_bad_file_type(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([math_row(i) for i in range(1, 5)])}).save_to_disk(
        str(tmp_path / "saved"))
    source = source_for("data=math", f"data.path={tmp_path / 'saved'}", "data.validation_size=1")
    assert (source.size("train"), source.size("validation")) == (3, 1)
    (tmp_path / "rows.csv").write_text("problem,solution\n")
    with pytest.raises(DataError, match=r"rows.csv': a local file must be .json, .jsonl or .parquet"):
        source_for("data=math", f"data.path={tmp_path / 'rows.csv'}")


def test_prompt_answer_accepts_chat_prompts_and_refuses_unknown_roles(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": chat, "answer": "4"}] * 3)
    source = source_for("data=prompt_answer", f"data.path={tmp_path}", "data.validation_size=1")
    assert source.example("train", 0).messages == chat and source.example("train", 0).prompt == "2+2?"
    assert source.example("train", 0).response == "4"

    write_jsonl(tmp_path / "train.jsonl", [{"prompt": chat, "answer": "4"}, {"prompt": [{"role": "robot",
                                                                                        "content": "hi"}], "answer": "1"}])
    with pytest.raises(DataError, match=r"split 'train' row 1: message 0 has role 'robot'.*'system', 'user'"):
        source_for("data=prompt_answer", f"data.path={tmp_path}", "data.validation_size=1")


def test_a_missing_column_names_the_dataset_split_and_columns(gsm8k_dir):
    with pytest.raises(DataError) as err:
        gsm8k_source(gsm8k_dir, "data.columns.prompt=problem")
    assert str(err.value) == (f"{gsm8k_dir} split 'train' has no column 'problem' (data.columns.prompt); its columns "
                              f"are ['question', 'answer']")


def test_an_empty_split_is_an_error(tmp_path, monkeypatch):
    pq.write_table(pa.Table.from_pylist([math_row(1)]), tmp_path / "train.parquet")
    pq.write_table(pa.table({"problem": pa.array([], pa.string()), "solution": pa.array([], pa.string())}),
                   tmp_path / "test.parquet")
    with pytest.raises(DataError, match=rf"{tmp_path / 'test.parquet'} \(data.path\) holds no rows: an empty split"):
        source_for("data=math", f"data.path={tmp_path}")
    (tmp_path / "test.parquet").unlink()
    (tmp_path / "test.jsonl").write_text("\n")
    with pytest.raises(DataError, match=rf"{tmp_path / 'test.jsonl'} \(data.path\) holds no rows"):
        source_for("data=math", f"data.path={tmp_path}")

    import datasets  # a hub dataset with an empty split

    (tmp_path / "test.jsonl").unlink()
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: {
        "train": datasets.Dataset.from_list([math_row(1), math_row(2)]),
        "test": datasets.Dataset.from_dict({"problem": [], "solution": []})})
    with pytest.raises(DataError, match=r"^someone/math split 'test' \(data.splits.test\) is empty$"):
        source_for("data=math", "data.path=someone/math", "data.config=null", "data.validation_size=1")


def test_malformed_rows_and_sizes_are_named(tmp_path, gsm8k_dir):
    write_jsonl(tmp_path / "train.jsonl", [gsm8k_row(0), {"question": "q", "answer": "no marker here"}])
    with pytest.raises(DataError, match=r"split 'train' row 1: column 'answer' .* must end with '#### <final answer>'"):
        source_for("data=gsm8k", f"data.path={tmp_path}")
    write_jsonl(tmp_path / "train.jsonl", [{"problem": "p", "solution": "no box"}])
    with pytest.raises(DataError, match=r"row 0: column 'solution' .* has no \\boxed"):
        source_for("data=math", f"data.path={tmp_path}")
    with pytest.raises(DataError, match=r"data.validation_size=12 leaves no training examples: .* has 12"):
        gsm8k_source(gsm8k_dir, "data.validation_size=12")


def test_an_unreachable_hub_name_is_a_clear_error(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"data.path='openai/gsm8k' \(data.config='main'\) could not be loaded from "
                                        r"the Hugging Face hub: ConnectionError.*set data.path to that local directory"):
        source_for("data=gsm8k")


def test_config_rules_name_the_keys(make_config, gsm8k_dir):
    from posttrain.config.check import check_config

    with pytest.raises(ConfigError, match="eval.split=validation needs data.splits.validation .* data.validation_size"):
        check_config(make_config("data=gsm8k", "data.validation_size=0"))
    with pytest.raises(ConfigError, match="eval.split=test needs data.splits.test"):
        check_config(make_config("data=gsm8k", "data.splits.test=null", "eval.split=test"))
    with pytest.raises(ConfigError, match="data.source=math reads data.columns.solution, which is null"):
        check_config(make_config("data=math", "data.columns.solution=null"))
    with pytest.raises(ConfigError, match="data.template='cot' is not valid"):
        check_config(make_config("data=gsm8k", "data.template=cot"))


# --- chat rendering -----------------------------------------------------------------------

def test_chat_prompts_render_with_the_model_template(tiny_hf_model, gsm8k_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_hf_model("qwen2"))
    example = gsm8k_source(gsm8k_dir, "data.template=r1").example("test", 0)
    text = prompt_text(example, tokenizer)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = prompt_token_ids(example, tokenizer)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # special tokens, not their letters

    batch = collate_sft([example], tokenizer)  # SFT: rendered prompt + response + EOS, loss on the response only
    response = tokenizer(example.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert batch["input_ids"][0].tolist() == ids + response
    assert batch["labels"][0].tolist() == [-100] * len(ids) + response


def test_llama_template_writes_its_bos_once(tiny_hf_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_hf_model("llama"))
    ids = prompt_token_ids(Example("2+2?", "4", "4", messages=[{"role": "user", "content": "2+2?"}]), tokenizer)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_a_tokenizer_without_chat_template_is_a_clear_error(tiny_hf_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_hf_model("qwen2_base"))
    example = Example("2+2?", "4", "4", messages=[{"role": "user", "content": "2+2?"}])
    with pytest.raises(DataError, match=r"tiny-qwen2_base' has no chat template .* set data.chat=false"):
        prompt_token_ids(example, tokenizer)
    assert prompt_token_ids(Example("2+2?", "4", "4"), tokenizer)  # plain text still works


def test_jsonl_prompts_may_be_chats(tmp_path):
    chat = [{"role": "user", "content": "1+1="}]
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": chat, "response": "2", "answer": "2"},
                                                  {"prompt": "3+3=", "response": "6"}])
    source = JsonlSource({"train": str(path)})
    assert source.example("train", 0).messages == chat and source.example("train", 0).prompt == "1+1="
    assert source.example("train", 1).messages is None
    path.write_text(json.dumps({"prompt": [{"role": "narrator", "content": "x"}], "response": "y"}) + "\n")
    with pytest.raises(DataError, match=rf"{path}:1 \(data.files.train\): message 0 has role 'narrator'"):
        JsonlSource({"train": str(path)})


# --- verifier timeouts reach the reward metrics ----------------------------------------------

def test_verifier_timeouts_are_counted_in_the_reward_metrics(gsm8k_dir):
    from posttrain.data.answers import AnswerChecker

    source = gsm8k_source(gsm8k_dir)
    source.checker = AnswerChecker(timeout_s=1.0, check=hang_on_marked_answer)
    example = source.example("test", 0)
    samples = [ScoredSample(example, text, 5, False, 0) for text in ("\\boxed{172}", "\\boxed{hang}", "#### 172")]
    try:
        output = CompositeReward([(AccuracyReward(), 1.0)])(samples, source)
        assert output.components["accuracy"].tolist() == [1.0, 0.0, 1.0]  # the hang counts as wrong
        assert output.metrics["rewards/verifier_timeouts"] == 1.0
        assert CompositeReward([(AccuracyReward(), 1.0)])(samples[:1], source).metrics["rewards/verifier_timeouts"] == 0
    finally:
        source.checker.close()


# --- end to end ---------------------------------------------------------------------------

def test_grpo_on_gsm8k_shaped_data_with_a_chat_model(tiny_hf_model, gsm8k_dir, make_config):
    from posttrain.train import run

    cfg = make_config(*FAST_RUN, "model=hf", f"model.name_or_path={tiny_hf_model('qwen2')}", "model.dtype=float32",
                      "data=gsm8k", f"data.path={gsm8k_dir}", "data.validation_size=4", "data.max_response_tokens=8",
                      "algorithm=grpo", "algorithm.warm_start.steps=0", "algorithm.prompts_per_step=2",
                      "algorithm.group_size=2", "trainer.max_steps=2", "trainer.val_check_interval=2",
                      "callbacks.checkpoint.every_n_train_steps=2", "eval.num_prompts=4", "eval.batch_size=4",
                      "eval.at_start=false")
    summary = run(cfg)
    assert summary["global_step"] == 2 and 0.0 <= summary["eval/accuracy"] <= 1.0
    history = read_history(Path(cfg.paths.output_dir) / HISTORY_FILE)
    assert list(history["rewards/verifier_timeouts"].values()) == [0.0, 0.0]  # logged each batch, none cut


def test_the_grpo_gsm8k_recipe_runs_on_local_copies_of_its_model_and_data(tiny_hf_model, gsm8k_dir, make_config):
    """experiment=grpo_gsm8k as a user without a hub runs it: local model and data directories
    in place of the hub names, on the CPU, with a tiny budget; the recipe's own choices hold."""
    from posttrain.train import run

    cfg = make_config(*FAST_RUN, "experiment=grpo_gsm8k", f"model.name_or_path={tiny_hf_model('qwen2')}",
                      f"data.path={gsm8k_dir}", "data.validation_size=4", "data.max_response_tokens=8",
                      "trainer=cpu", "algorithm.prompts_per_step=2", "algorithm.group_size=2",
                      "algorithm.micro_batch_size=2", "trainer.max_steps=2", "trainer.val_check_interval=2",
                      "eval.num_prompts=4", "eval.batch_size=4", "eval.at_start=false")
    assert (cfg.data.template, cfg.data.chat, cfg.algorithm.warm_start.steps) == ("boxed", True, 0)
    summary = run(cfg)
    assert summary["global_step"] == 2 and summary["warm_start"] is None
    assert summary["choices"]["model"] == "qwen2.5_0.5b_instruct" and summary["choices"]["data"] == "gsm8k"
