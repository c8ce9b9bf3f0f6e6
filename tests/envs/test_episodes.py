"""Multi-turn episodes, token in, token out (envs/episodes.py and the collector): the trainer
sees the ids the policy sampled, the environment's ids between its turns are read but masked out
of every loss, each turn's reward lands at the turn's last token, partial rollouts pause and
resume an episode (through a checkpoint too), and held-out evaluation plays episodes."""

import dataclasses
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import FAST_RUN, module_from_config

from posttrain.algorithms.base import generate_and_score
from posttrain.algorithms.online.collect import Collector, CollectSettings
from posttrain.data.datamodule import collate_prompts
from posttrain.data.guess_number import HIGHER, LOWER, GuessNumberSource
from posttrain.envs.base import Environment, Reply, observation_ids
from posttrain.envs.guess_number import GuessNumber
from posttrain.errors import ConfigError
from posttrain.models.forward import sequence_logprobs
from posttrain.models.tiny import build_char_tokenizer
from posttrain.rewards.build import build_reward
from posttrain.rollout import RolloutBatch, SamplingParams


class ScriptedGuesser:
    """A sampler whose k-th turn in every row writes `guesses[k]` as the given token ids, then
    an end-of-turn token; log-prob of the j-th token of turn k: -(10 k + j + 1) / 100. Turns are
    counted by the end-of-turn tokens already in the row; a call of `max_new_tokens` < the turn's
    length gives its first tokens, and the next call (the row continued) the rest."""

    def __init__(self, guesses: list[list[int]], eos: int, pad: int, prompt_len: int):
        self.guesses, self.eos, self.pad, self.prompt_len = guesses, eos, pad, prompt_len
        self.calls = 0

    def turn_of(self, row: list[int]) -> tuple[int, int]:
        """(turn index, tokens of it already given) for a row: its prompt, then what it has so far."""
        tail = row[self.prompt_len:]
        turn = tail.count(self.eos)
        since = tail[::-1].index(self.eos) if self.eos in tail else len(tail)
        # the tokens after the last end-of-turn token that are the policy's: the row ends either
        # with an observation (a new turn starts) or inside a turn
        script = self.guesses[min(turn, len(self.guesses) - 1)]
        # a turn under way ends the row with the start of its script; else (an observation) a turn begins
        given = max((k for k in range(1, min(since, len(script)) + 1) if tail[-k:] == script[:k]), default=0)
        return turn, given

    def generate(self, prompt_ids, prompt_mask, params, generator=None):
        self.calls += 1
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        width = params.max_new_tokens
        tokens = torch.full((len(rows), width), self.pad)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        logprobs = torch.zeros((len(rows), width))
        truncated = torch.zeros(len(rows), dtype=torch.bool)
        for i, row in enumerate(rows):
            turn, given = self.turn_of(row)
            plan = self.guesses[min(turn, len(self.guesses) - 1)] + [self.eos]
            segment = plan[given:given + width]
            tokens[i, :len(segment)], mask[i, :len(segment)] = torch.tensor(segment), 1
            logprobs[i, :len(segment)] = -torch.tensor([10 * turn + j + 1 for j in range(given, given + len(segment))]) / 100
            truncated[i] = self.eos not in segment
        return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=tokens, response_mask=mask,
                            logprobs=logprobs, truncated=truncated, repeated=torch.zeros(len(rows), dtype=torch.bool))


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def source():
    return GuessNumberSource(max_number=16, max_turns=3, seed=0)


def collector_for(source, tokenizer, guesses, *, partial_budget=None, max_new_tokens=40, env=None):
    example = source.example("train", 0)
    sampler = ScriptedGuesser(guesses, tokenizer.eos_token_id, tokenizer.pad_token_id,
                              prompt_len=len(ids_of(tokenizer, example.prompt)))
    reward = build_reward({"components": {"environment": {"weight": 2.0}}}, source, max_new_tokens)
    settings = CollectSettings(SamplingParams(max_new_tokens=max_new_tokens), group_size=2, prompts_per_step=1,
                               seed=0, eos_ids=[tokenizer.eos_token_id], partial_budget=partial_budget,
                               env=env or GuessNumber(max_turns=3), turn_tokens=6)
    curriculum = SimpleNamespace(state_dict=lambda: {})  # what state_dict reads; no prompts are drawn through it
    return Collector(sampler, tokenizer, source, curriculum, reward, settings), sampler, example


def test_the_trainer_sees_the_sampled_ids_where_re_encoding_would_change_them(source):
    # "12" is one token of this vocabulary: the policy sampling "1" then "2" is a non-canonical
    # tokenisation, which decoding and re-encoding its turn would merge
    tokenizer = build_char_tokenizer([*source.alphabet, "12"])
    one, two = ids_of(tokenizer, "1") + ids_of(tokenizer, "2")
    assert ids_of(tokenizer, "12") != [one, two], "the vocabulary must merge 12 for this test to mean anything"
    secret = int(source.example("train", 0).answer)
    right = ids_of(tokenizer, str(secret))
    collector, _, example = collector_for(source, tokenizer, [[one, two], ids_of(tokenizer, "1"), right])
    exp, metrics = collector.sample_and_score([example], 0, torch.Generator())
    eos = tokenizer.eos_token_id
    first_reply = ids_of(tokenizer, LOWER if secret < 12 else HIGHER)
    second_reply = ids_of(tokenizer, HIGHER if secret > 1 else LOWER)
    expected = [one, two, eos, *first_reply, *ids_of(tokenizer, "1"), eos, *second_reply, *right, eos]
    n = len(expected)
    for row in range(2):
        assert exp.response_ids[row, :n].tolist() == expected
        env = [0] * 3 + [1] * len(first_reply) + [0] * 2 + [1] * len(second_reply) + [0] * (len(right) + 1)
        assert exp.env_mask[row, :n].tolist() == env
        assert exp.response_mask[row, :n].tolist() == [1 - e for e in env]  # the loss sees the policy's alone
        assert exp.response_mask[row, n:].sum() == 0 and exp.env_mask[row, n:].sum() == 0
        # the sampler's log-prob of every policy token kept, 0 on the environment's
        policy = exp.rollout_logprobs[row, :n][exp.response_mask[row, :n].bool()]
        assert torch.allclose(policy, -torch.tensor([1, 2, 3, 11, 12, *[21 + j for j in range(len(right) + 1)]]) / 100)
        assert exp.rollout_logprobs[row, :n][exp.env_mask[row, :n].bool()].abs().sum() == 0
        # reward 1 at the last turn's end-of-turn token, times the component's weight (2); the total in scores
        turn_ends = [i for i, token in enumerate(expected) if token == eos]
        assert exp.turn_rewards[row, turn_ends].tolist() == [0.0, 0.0, 2.0]
        assert exp.turn_rewards[row].sum() == 2.0 and float(exp.scores[row]) == 2.0
        assert int(exp.turns[row]) == 3 and float(exp.correct[row]) == 1.0
    assert metrics["episode/turns"] == 3.0 and metrics["episode/reward_turn2"] == 1.0


def test_an_episode_ends_at_max_turns_and_at_the_budget(source):
    tokenizer = build_char_tokenizer(source.alphabet)
    secret = int(source.example("train", 0).answer)
    wrong = ids_of(tokenizer, str(secret % 16 + 1))
    collector, _, example = collector_for(source, tokenizer, [wrong] * 5)
    exp, _ = collector.sample_and_score([example], 0, torch.Generator())
    assert exp.turns.tolist() == [3, 3] and exp.correct.tolist() == [0.0, 0.0] and exp.scores.tolist() == [0.0, 0.0]
    assert not exp.truncated.any()  # the environment ended it, not the budget
    # a budget with room for one turn and its reply only: the second turn cannot start
    collector, _, example = collector_for(source, tokenizer, [wrong] * 5, max_new_tokens=len(wrong) + 1 + 7)
    exp, metrics = collector.sample_and_score([example], 0, torch.Generator())
    assert exp.turns.tolist() == [1, 1] and exp.truncated.all() and metrics["episode/budget_ended"] == 1.0
    assert exp.env_mask.sum() == 0  # the reply that did not fit was not appended


def test_partial_rollouts_pause_an_episode_and_resume_it_through_a_checkpoint(source):
    tokenizer = build_char_tokenizer(source.alphabet)
    secret = int(source.example("train", 0).answer)
    guesses = [ids_of(tokenizer, "10"), ids_of(tokenizer, "3"), ids_of(tokenizer, str(secret))]
    whole, _, example = collector_for(source, tokenizer, guesses)
    expected, _ = whole.sample_and_score([example], 0, torch.Generator())
    # one token per call: every turn takes two or three calls, the episode about eight
    partial, sampler, _ = collector_for(source, tokenizer, guesses, partial_budget=1)
    partial.continue_partial([example], torch.Generator())
    partial.continue_partial([], torch.Generator())
    partial.continue_partial([], torch.Generator())
    assert partial.pending and not partial.pending[0].ended and partial.pending[0].turns >= 1  # paused mid-episode
    buffer = io.BytesIO()
    torch.save(partial.state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    resumed, _, _ = collector_for(source, tokenizer, guesses, partial_budget=1)
    resumed.load_partial_state(state)  # the episodes are replayed to where they were
    exp = None
    for _ in range(20):
        exp, _ = resumed.continue_partial([], torch.Generator())
        if exp is not None:
            break
    assert exp is not None
    for name in ("response_ids", "response_mask", "env_mask", "turn_rewards", "rollout_logprobs"):
        assert torch.equal(getattr(exp, name), getattr(expected, name)), name
    for name in ("scores", "turns", "correct"):
        assert torch.equal(getattr(exp, name), getattr(expected, name)), name
    assert (exp.segments > 3).all()


def test_a_resumed_episode_whose_environment_answers_differently_is_refused(source):
    tokenizer = build_char_tokenizer(source.alphabet)
    guesses = [ids_of(tokenizer, "10"), ids_of(tokenizer, "3"), ids_of(tokenizer, "4")]
    partial, _, example = collector_for(source, tokenizer, guesses, partial_budget=1)
    for examples in ([example], [], [], []):
        partial.continue_partial(examples, torch.Generator())
    state = partial.state_dict()

    class Liar(GuessNumber):
        def start(self, example):
            episode = super().start(example)
            episode.secret = 17 - episode.secret  # another secret: other replies
            return episode

    resumed, _, _ = collector_for(source, tokenizer, guesses, partial_budget=1, env=Liar(max_turns=3))
    if int(example.answer) != 17 - int(example.answer):
        with pytest.raises(Exception, match="replaying turn 0"):
            resumed.load_partial_state(state)


def test_a_reply_the_tokenizer_cannot_spell_is_an_error_naming_it(source):
    tokenizer = build_char_tokenizer(source.alphabet)
    with pytest.raises(ConfigError, match="does not know"):
        observation_ids(Reply(text="Quite WARM!"), tokenizer)


def test_environment_tokens_are_read_by_the_forward_and_scored_by_no_loss(make_config):
    cfg = make_config(*FAST_RUN, "experiment=guess_number", "algorithm.prompts_per_step=2", "algorithm.group_size=2",
                      "algorithm.warm_start=null")
    module = module_from_config(cfg)
    tokenizer = module.tokenizer
    guesses = [ids_of(tokenizer, "4"), ids_of(tokenizer, "6"), ids_of(tokenizer, "7")]
    module.rollouts.collector.sampler = ScriptedGuesser(guesses, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                                        prompt_len=len(ids_of(tokenizer, "guess:")))
    exp = module.rollouts.collector.collect(0).experience.without_trailing_padding()
    assert exp.env_mask.sum() > 0
    logp = module.scoring.logprobs(module.policy, exp)
    assert logp[exp.env_mask.bool()].abs().sum() == 0
    # each policy token's log-prob is the one a plain forward of the whole sequence gives it
    full = torch.cat([exp.prompt_ids, exp.response_ids], dim=1)
    attention = torch.cat([exp.prompt_mask, exp.sequence_mask().long()], dim=1)
    with torch.no_grad():
        logits = module.policy(input_ids=full, attention_mask=attention,
                               position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits
    plain = logits[:, exp.prompt_ids.shape[1] - 1:-1].float().log_softmax(-1).gather(
        -1, exp.response_ids[..., None])[..., 0]
    policy = exp.response_mask.bool()
    assert torch.allclose(logp[policy], plain[policy], atol=1e-5)
    # the rewards: each turn's where it was earned, the whole score in all (GRPO sums them back)
    exp, _ = module.compute_advantages(module.annotate(exp))
    assert torch.allclose(exp.token_rewards.sum(1), exp.scores)
    assert module.learner.loss_mask(exp)[exp.env_mask.bool()].sum() == 0  # no loss term counts them


def test_held_out_evaluation_plays_episodes(make_config):
    cfg = make_config(*FAST_RUN, "experiment=guess_number", "algorithm.warm_start=null")
    module = module_from_config(cfg)
    tokenizer = module.tokenizer
    examples = [module.source.example("validation", i) for i in range(6)]
    guesses = [ids_of(tokenizer, "4"), ids_of(tokenizer, "6"), ids_of(tokenizer, "5")]
    scripted = ScriptedGuesser(guesses, tokenizer.eos_token_id, tokenizer.pad_token_id,
                               prompt_len=len(ids_of(tokenizer, "guess:")))
    module.generate = lambda ids, mask, params, generator=None: scripted.generate(ids, mask, params)
    batch = collate_prompts(examples, tokenizer)
    batch["examples"] = examples
    scored = generate_and_score(module, batch, module.greedy_params())
    for example, correct, parts in zip(examples, scored.correct, scored.transcripts):
        secret = int(example.answer)  # the script guesses 4, 6, 5 whatever it is told
        assert sum(p["role"] == "policy" for p in parts) == (1 if secret == 4 else 2 if secret == 6 else 3)
        assert correct == float(secret in (4, 6, 5))  # the environment's verdict
    rows = module.sample_rows(examples, scored)
    assert all("transcript" in row for row in rows)
    for row, parts in zip(rows, scored.transcripts):
        assert row["response"].count("[env:") == sum(p["role"] == "env" for p in parts)  # its turns marked


def test_a_multi_turn_run_writes_whole_episodes_and_their_metrics(make_config, tmp_path):
    from posttrain.train import run

    cfg = make_config(*FAST_RUN, "experiment=guess_number", "algorithm.warm_start.steps=0", "logger=csv",
                      "algorithm.prompts_per_step=2", "algorithm.group_size=4", "trainer.max_steps=2",
                      "trainer.val_check_interval=2", "eval.num_prompts=8", "eval.batch_size=8", "eval.panel.size=4")
    summary = run(cfg, announce=False)
    assert summary["global_step"] == 2
    for name in ("eval/episode/turns", "eval/episode/invalid_guesses", "eval/episode/budget_ended"):
        assert name in summary
    assert 1.0 <= summary["eval/episode/turns"] <= 3.0
    out = Path(cfg.paths.output_dir)
    rows = [json.loads(line) for line in sorted((out / "samples").glob("*.jsonl"))[-1].read_text().splitlines()]
    panel = [json.loads(line) for line in sorted((out / "panel").glob("*.jsonl"))[-1].read_text().splitlines()]
    for row in rows + panel:
        roles = [part["role"] for part in row["transcript"]]
        assert roles[0] == "policy" and roles.count("env") == row["response"].count("[env:")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("episode/turns" in m and "episode/return" in m for m in metrics)


def test_posttrain_eval_plays_the_runs_episodes_and_reproduces_its_final_eval(tmp_path):
    """posttrain-eval of a guess_number run: the run's environment, and its exported tokenizer
    spelling the replies' spaces and newlines as training did (it reloads the tokenizer.json as it
    is, not as the model type's tokenizer class would)."""
    import sys

    from forked_cli import run_command

    log_dir = tmp_path / "logs"
    train = [sys.executable, "-m", "posttrain.train", "experiment=guess_number", "algorithm.warm_start.steps=30",
             "algorithm.prompts_per_step=2", "algorithm.group_size=4", "trainer.max_steps=2",
             "trainer.val_check_interval=2", "eval.at_start=false", "eval.num_prompts=16", "eval.batch_size=16",
             "logger=none", "callbacks.progress_bar=none", "num_threads=1", f"paths.log_dir={log_dir}"]
    result = run_command(train, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = log_dir.glob("guess_number/runs/*")
    evaluate = [sys.executable, "-m", "posttrain.eval.evaluate", f"checkpoint={run_dir}", "pass_k=[]",
                "num_threads=1", f"paths.log_dir={tmp_path / 'eval'}"]
    result = run_command(evaluate, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = (tmp_path / "eval").glob("eval/runs/*/eval.json")
    scored, summary = json.loads(path.read_text()), json.loads((run_dir / "summary.json").read_text())
    assert scored["eval/accuracy"] == summary["eval/accuracy"]
    assert scored["eval/response_len"] == summary["eval/response_len"]


def test_the_episode_judges_a_turn_the_budget_cut(source):
    tokenizer = build_char_tokenizer(source.alphabet)
    secret = int(source.example("train", 0).answer)
    long_guess = ids_of(tokenizer, str(secret)) * 9  # longer than the whole budget
    collector, _, example = collector_for(source, tokenizer, [long_guess], max_new_tokens=5)
    collector.episodes.budget.turn_tokens = None
    exp, metrics = collector.sample_and_score([example], 0, torch.Generator())
    assert exp.truncated.all() and exp.turns.tolist() == [1, 1]  # answered, not dropped
    assert exp.scores.tolist() == [0.0, 0.0] and metrics["episode/turns"] == 1.0


def test_the_episode_judges_a_turn_the_repetition_stop_ended(source):
    # the sampler's repetition stop ends a row: without the episode's verdict, the scorer would
    # fall back to the task source, which for env=code cannot judge (a 20-step SmolLM2 run died so)
    tokenizer = build_char_tokenizer(source.alphabet)
    right = ids_of(tokenizer, source.example("train", 0).answer)
    collector, sampler, example = collector_for(source, tokenizer, [right])
    generate = sampler.generate
    sampler.generate = lambda *args, **kwargs: dataclasses.replace(generate(*args, **kwargs), repeated=torch.ones(2, dtype=torch.bool))
    exp, metrics = collector.sample_and_score([example], 0, torch.Generator())
    assert exp.turns.tolist() == [1, 1] and exp.correct.tolist() == [1.0, 1.0] and metrics["episode/turns"] == 1.0
    # a wrong guess the stop cut: judged, and the trajectory ends without the episode's reply
    wrong = ids_of(tokenizer, str(int(source.example("train", 0).answer) % 16 + 1))
    collector, sampler, example = collector_for(source, tokenizer, [wrong])
    generate = sampler.generate
    sampler.generate = lambda *args, **kwargs: dataclasses.replace(generate(*args, **kwargs), repeated=torch.ones(2, dtype=torch.bool))
    exp, _ = collector.sample_and_score([example], 0, torch.Generator())
    assert exp.turns.tolist() == [1, 1] and exp.scores.tolist() == [0.0, 0.0] and exp.env_mask.sum() == 0


@pytest.mark.parametrize("setting", [("rollout=hf",), ("rollout.max_staleness=1",),
                                     ("rollout.dtype=bfloat16", "rollout.correction.tis=token")],
                         ids=["hf", "producer", "corrected"])
def test_episodes_run_with_each_engine_the_producer_and_the_corrections(make_config, setting):
    from posttrain.train import run

    cfg = make_config(*FAST_RUN, "experiment=guess_number", "algorithm.warm_start.steps=0", *setting,
                      "algorithm.prompts_per_step=2", "algorithm.group_size=4", "trainer.max_steps=2",
                      "trainer.val_check_interval=2", "eval.num_prompts=8", "eval.batch_size=8", "eval.at_start=false")
    summary = run(cfg, announce=False)
    assert summary["global_step"] == 2 and 1.0 <= summary["eval/episode/turns"] <= 3.0
