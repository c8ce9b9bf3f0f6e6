"""Preference pairs (data/preference.py): embedded pairs made with a policy on the arithmetic
task, dataset pairs in text and chat form, the collate layout, the cache and the errors."""

from __future__ import annotations

import json
import random

import pytest
import torch
from omegaconf import open_dict

from conftest import compose_config
from posttrain.data import preference
from posttrain.data.arithmetic import verify_answer
from posttrain.data.datamodule import ExampleStream, collate_sft
from posttrain.data.preference import PreferencePair, collate_pairs
from posttrain.prepare.preference_pairs import build_preference_source, pair_for_prompt, perturb_final_answer
from posttrain.data.sources import ArithmeticSource
from posttrain.errors import DataError
from posttrain.models.loading import load_tokenizer_and_model
from posttrain.rollout import RolloutBatch

SMALL_MODEL = ("model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64")


def pair_config(tmp_path, *overrides):
    return compose_config(["algorithm=reward_model", "algorithm.warm_start.steps=0", f"paths.cache_dir={tmp_path}",
                           *SMALL_MODEL, *overrides], tmp_path / "run")


def task_and_model(cfg):
    task = ArithmeticSource(seed=cfg.data.seed)
    tokenizer, policy = load_tokenizer_and_model(cfg.model, task.alphabet)
    return task, tokenizer, policy


class HalfRightEngine:
    """A stand-in sampler: of each prompt's samples the first `right` answer correctly, the rest
    answer one too many (so the pair kinds are known in advance). Counts its calls."""

    def __init__(self, tokenizer, samples_per_prompt, right):
        self.tokenizer, self.n, self.right, self.calls = tokenizer, samples_per_prompt, right, 0

    def generate(self, model, prompt_ids, prompt_mask, params, eos_token_id, pad_token_id, generator=None):
        self.calls += 1
        prompts = self.tokenizer.batch_decode([ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)])
        texts = [str(sum(map(int, p.rstrip("=").split("+"))) + (0 if row % self.n < self.right else 1))
                 for row, p in enumerate(prompts)]
        rows = [self.tokenizer(t, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id] for t in texts]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), pad_token_id)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
        return RolloutBatch(prompt_ids, prompt_mask, ids, mask, torch.zeros(ids.shape), torch.zeros(len(rows), dtype=torch.bool))


def use_engine(monkeypatch, engine):
    import posttrain.prepare.sampling

    monkeypatch.setattr(posttrain.prepare.sampling, "build_rollout", lambda name, **kwargs: engine)


def check_embedded(source, task):
    for split in ("train", "validation"):
        for pair in source.pairs(split):
            assert pair.example is not None and pair.prompt == pair.example.prompt
            assert verify_answer(pair.prompt, pair.chosen), pair
            assert not verify_answer(pair.prompt, pair.rejected), pair
            assert task.is_correct(pair.example, pair.chosen)


def test_embedded_pairs_are_on_policy_where_samples_disagree_and_cached(tmp_path, monkeypatch):
    cfg = pair_config(tmp_path, "preference.num_train_pairs=40", "preference.num_validation_pairs=12",
                      "preference.samples_per_prompt=3")
    task, tokenizer, policy = task_and_model(cfg)
    engine = HalfRightEngine(tokenizer, samples_per_prompt=3, right=1)
    use_engine(monkeypatch, engine)
    source = build_preference_source(cfg, task, tokenizer, policy)
    assert source.size("train") == 40 and source.size("validation") == 12
    assert source.shares("train") == {"on_policy": 1.0, "perturbed": 0.0, "shorter_right": 0.0, "dataset": 0.0}
    check_embedded(source, task)
    # the chosen side is the policy's own right sample, the rejected its wrong one
    first = source.pairs("train")[0]
    assert int(first.rejected) == int(first.chosen) + 1
    # disjoint prompts: training pairs from the task's train split, held-out from its validation split
    train_prompts = {p.prompt for p in source.pairs("train")}
    assert not train_prompts & {p.prompt for p in source.pairs("validation")}
    assert [p.prompt for p in source.pairs("validation")] == [task.example("validation", i).prompt for i in range(12)]
    # a second build reads the cache: the same pairs, no generation
    (cached,) = (tmp_path / "preference_pairs").glob("*.json")
    calls = engine.calls
    again = build_preference_source(cfg, task, tokenizer, policy)
    assert engine.calls == calls
    assert [(p.prompt, p.chosen, p.rejected, p.kind) for p in again.pairs("train")] == \
           [(p.prompt, p.chosen, p.rejected, p.kind) for p in source.pairs("train")]
    assert again.pairs("train")[3].example == source.pairs("train")[3].example
    # another pair setting is another cache entry
    with open_dict(cfg):
        cfg.preference.samples_per_prompt = 4
    engine.n = 4
    build_preference_source(cfg, task, tokenizer, policy)
    assert engine.calls > calls and len(list((tmp_path / "preference_pairs").glob("*.json"))) == 2
    assert cached.is_file()


def test_prompts_without_a_right_and_a_wrong_sample_get_perturbed_reference_pairs(tmp_path, monkeypatch):
    cfg = pair_config(tmp_path, "preference.num_train_pairs=30", "preference.num_validation_pairs=10",
                      "preference.samples_per_prompt=2", "preference.cache=false")
    task, tokenizer, policy = task_and_model(cfg)
    use_engine(monkeypatch, HalfRightEngine(tokenizer, samples_per_prompt=2, right=2))  # all right: no wrong one
    source = build_preference_source(cfg, task, tokenizer, policy)
    assert source.shares("validation")["perturbed"] == 1.0
    check_embedded(source, task)
    for pair in source.pairs("train"):
        assert pair.chosen == pair.example.response and len(pair.rejected) == len(pair.chosen)
        assert sum(a != b for a, b in zip(pair.chosen, pair.rejected)) == 1  # one digit changed
    assert not (tmp_path / "preference_pairs").exists()  # preference.cache=false


def test_embedded_pairs_from_the_real_sampler_mix_kinds_with_a_random_policy(tmp_path):
    cfg = pair_config(tmp_path, "preference.num_train_pairs=16", "preference.num_validation_pairs=8")
    task, tokenizer, policy = task_and_model(cfg)
    source = build_preference_source(cfg, task, tokenizer, policy)
    check_embedded(source, task)
    assert sum(source.shares("train").values()) == pytest.approx(1.0)


def test_pair_for_prompt_and_perturbation():
    task = ArithmeticSource()
    example = task.example("train", 0)
    right, wrong = example.response, str(int(example.response) + 3)
    pair = pair_for_prompt(example, [wrong, right, wrong], task, random.Random(0))
    assert (pair.kind, pair.chosen, pair.rejected) == ("on_policy", right, wrong)
    pair = pair_for_prompt(example, [wrong, wrong], task, random.Random(0))
    assert pair.kind == "perturbed" and pair.chosen == right and not task.is_correct(example, pair.rejected)
    # only the final number changes; a leading digit never becomes 0
    changed = perturb_final_answer("7+5=12>532", random.Random(1), lambda text: text != "7+5=12>532")
    assert changed.startswith("7+5=12>") and changed[7] != "0"
    assert perturb_final_answer("no digits", random.Random(0), lambda text: True) is None


def test_collate_pairs_has_the_sft_layout():
    task = ArithmeticSource()
    tokenizer, _ = load_tokenizer_and_model(pair_config_for_model(), task.alphabet)
    examples = [task.example("train", i) for i in range(3)]
    pairs = [PreferencePair(e.prompt, e.response, e.response + "1" * i, "perturbed", None, e)
             for i, e in enumerate(examples)]
    batch = collate_pairs(pairs, tokenizer)
    chosen_as_sft = collate_sft(examples, tokenizer)
    assert torch.equal(batch["chosen_input_ids"], chosen_as_sft["input_ids"])
    assert torch.equal(batch["chosen_labels"], chosen_as_sft["labels"])
    assert torch.equal(batch["chosen_attention_mask"], chosen_as_sft["attention_mask"])
    assert batch["rejected_len"].tolist() == [len(e.response) + 1 + i for i, e in enumerate(examples)]
    assert batch["chosen_len"].tolist() == [(row != -100).sum().item() for row in batch["chosen_labels"]]
    for row, length, mask in zip(batch["rejected_input_ids"], batch["rejected_len"], batch["rejected_attention_mask"]):
        assert row[mask.sum() - 1] == tokenizer.eos_token_id  # every row ends with EOS, then padding
    assert batch["pairs"] is pairs


def pair_config_for_model():
    return compose_config(list(SMALL_MODEL)).model


def test_pair_stream_is_a_seeded_resumable_order_over_the_pairs():
    task = ArithmeticSource()
    pairs = {"train": [PreferencePair(str(i), "1", "2", "dataset") for i in range(5)]}
    source = preference.PreferenceSource(task, pairs, "test pairs")
    stream = iter(ExampleStream(source, "train", start=0, seed=3, pairs=True))
    first = [next(stream).prompt for _ in range(10)]
    assert sorted(first[:5]) == sorted(first[5:]) == ["0", "1", "2", "3", "4"]  # each pass: every pair once
    resumed = iter(ExampleStream(source, "train", start=7, seed=3, pairs=True))
    assert [next(resumed).prompt for _ in range(3)] == first[7:10]
    # two data-parallel ranks take alternate positions: together, the one-process stream
    ranks = [iter(ExampleStream(source, "train", start=0, seed=3, rank=r, world_size=2, pairs=True)) for r in (0, 1)]
    assert [next(ranks[i % 2]).prompt for i in range(10)] == first


# --- dataset pairs --------------------------------------------------------------------------

def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dataset_source(tmp_path, path, *overrides):
    cfg = pair_config(tmp_path, "preference.source=dataset", f"preference.path={path}", *overrides)
    return build_preference_source(cfg, ArithmeticSource(), None, None)


def test_text_pairs_with_a_held_out_validation_split(tmp_path):
    rows = [{"question": f"q{i}", "good": f"g{i}", "bad": f"b{i}"} for i in range(10)]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    source = dataset_source(tmp_path, path, "preference.columns.prompt=question", "preference.columns.chosen=good",
                            "preference.columns.rejected=bad", "preference.validation_size=3")
    assert source.size("train") == 7 and source.size("validation") == 3
    assert source.shares("train")["dataset"] == 1.0
    assert not {p.prompt for p in source.pairs("train")} & {p.prompt for p in source.pairs("validation")}
    pair = source.pairs("train")[0]
    assert (pair.chosen, pair.rejected, pair.messages) == (f"g{pair.prompt[1:]}", f"b{pair.prompt[1:]}", None)


def test_conversation_pairs_take_the_prompt_turns_and_the_last_assistant_turn(tmp_path, tiny_hf_model):
    def conversation(answer):
        return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": answer}]

    path = write_jsonl(tmp_path / "chat.jsonl", [{"chosen": conversation("4"), "rejected": conversation("5")}] * 4)
    source = dataset_source(tmp_path, path, "preference.validation_size=1")
    pair = source.pairs("train")[0]
    assert (pair.prompt, pair.chosen, pair.rejected) == ("What is 2+2?", "4", "5")
    assert pair.messages == conversation("4")[:-1]
    # rendered with the chat template, the assistant's turn opened; labels on the response and EOS only
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_hf_model("qwen2"))
    batch = collate_pairs([pair], tokenizer)
    prompt_text = tokenizer.apply_chat_template(pair.messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    assert batch["chosen_input_ids"][0].tolist() == prompt + tokenizer("4", add_special_tokens=False)["input_ids"] + \
        [tokenizer.eos_token_id]
    assert (batch["chosen_labels"][0, : len(prompt)] == -100).all()


def test_text_prompts_become_a_user_turn_with_chat(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "hi", "chosen": "a", "rejected": "b"}] * 3)
    source = dataset_source(tmp_path, path, "preference.chat=true", "preference.validation_size=0")
    assert source.pairs("train")[0].messages == [{"role": "user", "content": "hi"}]


def test_a_missing_column_names_the_file_and_the_column(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "worse": "b"}] * 3)
    with pytest.raises(DataError, match=r"pairs\.jsonl.*no column 'rejected' \(preference\.columns\.rejected\)"):
        dataset_source(tmp_path, path)
    path = write_jsonl(tmp_path / "noprompt.jsonl", [{"chosen": "a", "rejected": "b"}] * 3)
    with pytest.raises(DataError, match=r"noprompt\.jsonl.*no column 'prompt' \(preference\.columns\.prompt\)"):
        dataset_source(tmp_path, path)


def test_an_empty_file_is_named(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl \(preference\.path\) holds no rows"):
        dataset_source(tmp_path, path)


def test_a_conversation_must_end_with_the_assistant(tmp_path):
    turns = [{"role": "user", "content": "q"}, {"role": "user", "content": "again"}]
    path = write_jsonl(tmp_path / "bad.jsonl", [{"chosen": turns, "rejected": turns}] * 2)
    with pytest.raises(DataError, match=r"row 0: column 'chosen' .*does not end with an assistant turn"):
        dataset_source(tmp_path, path, "preference.validation_size=0")


def test_only_rank_0_of_a_job_writes_the_pair_cache(tmp_path, monkeypatch):
    """Every rank of a data-parallel job makes the same embedded pairs (the same seeds), but
    only rank 0 writes files: the other ranks leave the cache alone."""
    from posttrain.distributed.collectives import RANK_VARIABLES

    cfg = pair_config(tmp_path, "preference.num_train_pairs=8", "preference.num_validation_pairs=4",
                      "preference.samples_per_prompt=2")
    task, tokenizer, policy = task_and_model(cfg)
    use_engine(monkeypatch, HalfRightEngine(tokenizer, samples_per_prompt=2, right=1))
    for names in RANK_VARIABLES:
        for name in names:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    second = build_preference_source(cfg, task, tokenizer, policy)
    assert not (tmp_path / "preference_pairs").exists()
    monkeypatch.setenv("RANK", "0")
    first = build_preference_source(cfg, task, tokenizer, policy)
    assert len(list((tmp_path / "preference_pairs").glob("*.json"))) == 1
    assert [(p.prompt, p.chosen, p.rejected) for p in first.pairs("train")] == \
           [(p.prompt, p.chosen, p.rejected) for p in second.pairs("train")]


def test_a_pair_longer_than_the_models_context_is_named_before_training(tmp_path, tiny_hf_model):
    """A conversation pair (the UltraFeedback / HH layout) whose prompt + response + EOS does not
    fit the model's context: a DataError naming the file and row, not a crash in the model."""
    from transformers import AutoTokenizer

    def conversation(answer):
        return [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": answer}]

    tokenizer = AutoTokenizer.from_pretrained(tiny_hf_model("qwen2"))
    rows = [{"chosen": conversation("4"), "rejected": conversation("5")} for _ in range(6)]
    path = write_jsonl(tmp_path / "ultrafeedback.jsonl", rows)
    cfg = pair_config(tmp_path, "preference.source=dataset", f"preference.path={path}", "preference.validation_size=2")
    fitting = collate_pairs(build_preference_source(cfg, ArithmeticSource(), None, None).pairs("train"), tokenizer)
    tokenizer.model_max_length = fitting["chosen_input_ids"].shape[1] + 4  # where the loader records the context
    build_preference_source(cfg, ArithmeticSource(), tokenizer, None)  # every pair fits

    rows[4]["rejected"] = conversation("four " * 10)
    write_jsonl(path, rows)
    with pytest.raises(DataError, match=r"ultrafeedback\.jsonl .*row 4: prompt \(\d+ tokens\) \+ rejected response "
                                        r"\(\d+ tokens\) \+ EOS is \d+ tokens, more than the model's context of "
                                        rf"{tokenizer.model_max_length} tokens.*1 of the \d (train|validation) pairs"):
        build_preference_source(cfg, ArithmeticSource(), tokenizer, None)


class TruncatedWrongEngine(HalfRightEngine):
    """As HalfRightEngine, but its wrong samples hit the generation budget: no EOS, truncated."""

    def generate(self, model, prompt_ids, prompt_mask, params, eos_token_id, pad_token_id, generator=None):
        batch = super().generate(model, prompt_ids, prompt_mask, params, eos_token_id, pad_token_id, generator)
        wrong = torch.tensor([row % self.n >= self.right for row in range(len(prompt_ids))])
        rows = wrong.nonzero().squeeze(1)
        last = batch.response_mask.sum(dim=1)[rows] - 1
        batch.response_ids[rows, last], batch.response_mask[rows, last] = pad_token_id, 0
        batch.truncated = wrong
        return batch


def test_an_on_policy_side_cut_by_the_budget_gets_no_eos(tmp_path, monkeypatch):
    cfg = pair_config(tmp_path, "preference.num_train_pairs=6", "preference.num_validation_pairs=2",
                      "preference.samples_per_prompt=2")
    task, tokenizer, policy = task_and_model(cfg)
    use_engine(monkeypatch, TruncatedWrongEngine(tokenizer, samples_per_prompt=2, right=1))
    built = build_preference_source(cfg, task, tokenizer, policy).pairs("train")
    cached = build_preference_source(cfg, task, tokenizer, policy).pairs("train")  # read back from the cache
    for pairs in (built, cached):
        assert {pair.kind for pair in pairs} == {"on_policy"}
        batch = collate_pairs(pairs, tokenizer)
        for side, ended in (("chosen", True), ("rejected", False)):
            tokens = tokenizer([getattr(pair, side) for pair in pairs], add_special_tokens=False)["input_ids"]
            assert batch[f"{side}_len"].tolist() == [len(ids) + ended for ids in tokens]
            for row, mask in zip(batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"]):
                assert (row[mask.sum() - 1] == tokenizer.eos_token_id) == ended
