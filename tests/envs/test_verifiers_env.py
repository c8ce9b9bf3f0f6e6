"""env=verifiers: environments written for verifiers 0.4.0, built here from local data (no hub, no
network), played through posttrain's environment interface: a single-turn taskset with a rubric of
two weighted functions, a multi-turn Env whose run answers each guess, a tool taskset, and two
steps through the CLI on the embedded model."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import string
import sys
import textwrap

import pytest

from posttrain.config.check import check_config
from posttrain.data.examples import Example
from posttrain.data.verifiers_source import VerifiersSource, load_verifiers_environment
from posttrain.envs.base import Turn, observation_ids
from posttrain.envs.verifiers_env import VerifiersEnvironment
from posttrain.errors import ConfigError, RewardError
from posttrain.models.tiny import build_char_tokenizer


@pytest.fixture(autouse=True)
def verifiers_installed():
    """Imported by the tests, not at collection: verifiers takes 10 s to import, and every xdist
    worker collects this file while one runs it."""
    pytest.importorskip("verifiers.v1", reason="pip install 'posttrain[verifiers]'")

# Three environments a user would write, as modules on the path (verifiers finds a package by its
# module name: `vf_sums` exports its Taskset in __all__; the others are loaded by function).
MODULES = {
    "vf_sums": '''
        import math
        import verifiers.v1 as vf

        class SumData(vf.TaskData):
            answer: str

        class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
            @vf.reward(weight=1.0)
            async def exact(self, task, trace) -> float:
                return float(trace.last_reply == task.answer)

            @vf.reward(weight=0.5)
            async def short(self, trace) -> float:
                return float(len(trace.last_reply) <= 2)

        class SumConfig(vf.TasksetConfig):
            count: int = 6
            broken: str = ""   # "raise" or "nan": the exact reward misbehaves

        class SumTaskset(vf.Taskset[SumTask, SumConfig]):
            def load(self):
                for i in range(self.config.count):
                    yield SumTask(SumData(prompt=f"{i}+1=", system_prompt="sum", answer=str(i + 1)), self.config.task)

        class BrokenTask(SumTask):
            @vf.reward(weight=1.0)
            async def exact(self, task, trace) -> float:
                if "raise" in task.system_prompt:
                    raise KeyError("answer_key")
                return math.nan

        class BrokenTaskset(vf.Taskset[BrokenTask, SumConfig]):
            def load(self):
                for i in range(4):
                    yield BrokenTask(SumData(prompt=f"{i}+1=", system_prompt=self.config.broken, answer=str(i + 1)),
                                     self.config.task)

        def broken(kind):
            return BrokenTaskset(SumConfig(broken=kind))

        __all__ = ["SumTaskset"]
    ''',
    "vf_guess": '''
        import verifiers.v1 as vf

        class GuessData(vf.TaskData):
            secret: int

        class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
            @vf.reward(weight=1.0)
            async def found(self, task, trace) -> float:
                return float(trace.last_reply == str(task.secret))

        class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
            def load(self):
                for secret in (5, 6, 7, 2, 3, 4):
                    yield GuessTask(GuessData(prompt="guess a number from 1 to 9", secret=secret), self.config.task)

        class GuessEnv(vf.Env[vf.SingleAgentEnvConfig]):
            """After each guess the user says higher or lower; a right guess ends the game with a bonus."""

            async def run(self, task, agents):
                async with agents.agent.interaction(task) as talk:
                    segment = await talk.turn()
                    while not segment.terminated:
                        guess = segment.last_reply
                        if guess == str(task.data.secret):
                            talk.trace.record_reward("bonus", 1.0, 0.5)
                            break
                        low = guess.isdigit() and int(guess) < task.data.secret
                        segment = await talk.turn("higher" if low else "lower")

            async def finalize(self, task, episode):
                episode.traces[0].record_reward("finalized", 1.0, 0.25)

        class TwoSeatsEnv(vf.Env[vf.SingleAgentEnvConfig]):
            """A second agent answers the first: a user simulator."""

            async def run(self, task, agents):
                await agents.agent.run(task)
                await agents.user.run(task)

        class StoppingTask(GuessTask):
            @vf.stop
            async def enough(self, trace) -> bool:
                return trace.num_turns > 2

        class StoppingTaskset(vf.Taskset[StoppingTask, vf.TasksetConfig]):
            def load(self):
                yield StoppingTask(GuessData(prompt="guess", secret=1), self.config.task)

        def two_seats():
            return TwoSeatsEnv(vf.SingleAgentEnvConfig(taskset={"id": "vf_guess"}))

        def stopping():
            return StoppingTaskset(vf.TasksetConfig())

        __all__ = ["GuessTaskset", "GuessEnv"]
    ''',
    "vf_calc": '''
        import verifiers.v1 as vf

        class CalcData(vf.TaskData):
            answer: str

        class Calculator(vf.Toolset[vf.ToolsetConfig]):
            @vf.tool
            def add(self, a: int, b: int) -> str:
                """Add two integers."""
                return str(a + b)

        class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
            @classmethod
            def toolsets(cls, config):
                return [Calculator(vf.ToolsetConfig())]

            @vf.reward
            async def right(self, task, trace) -> float:
                return float(trace.last_reply == task.answer)

            @vf.reward(weight=0.0)
            async def used_tool(self, trace) -> float:
                return float(len(trace.tool_messages) > 0)

            @vf.metric
            async def linked(self, trace) -> float:  # each result names the call it answers
                calls = [call.id for message in trace.assistant_messages for call in message.tool_calls or ()]
                return float(calls == [message.tool_call_id for message in trace.tool_messages])

        class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
            def load(self):
                for a in range(4):
                    yield CalcTask(CalcData(prompt=f"what is {a} + 40?", answer=str(a + 40)), self.config.task)

        def make():
            return CalcTaskset(vf.TasksetConfig())
    ''',
}


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vf_envs")
    for name, text in MODULES.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(text))
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))


def played(load, args=None, max_turns=4, heldout_size=1):
    """The environment and its data source, attached as a run attaches them."""
    environment = VerifiersEnvironment(load, args, max_turns=max_turns)
    source = VerifiersSource(load_verifiers_environment(load, args), None, heldout_size, chat=True)
    environment.attach(source)
    return environment, source


def play(environment, example, turns):
    episode = environment.start(environment.prepare(example))
    return [episode.step(Turn(text, [], True, index)) for index, text in enumerate(turns)]


# --- single turn: the rubric -----------------------------------------------------------------

def test_the_tasks_become_examples_in_three_splits(modules):
    _, source = played("vf_sums", {"count": 6})
    assert [source.size(split) for split in ("validation", "test", "train")] == [1, 1, 4]
    example = source.example("train", 0)  # the third task: 2+1=
    assert example.messages == [{"role": "system", "content": "sum"}, {"role": "user", "content": "2+1="}]
    assert example.response == "" and json.loads(example.answer)["answer"] == "3"  # the task's wire data


@pytest.mark.parametrize("response, exact, short", [("3", 1.0, 1.0), ("33", 0.0, 1.0), ("3333", 0.0, 0.0)])
def test_each_rubric_function_is_a_component_and_the_reward_their_weighted_sum(modules, response, exact, short):
    environment, source = played("vf_sums", {"count": 6})
    assert environment.metric_names == ("rubric_exact", "rubric_short")
    (reply,) = play(environment, source.example("train", 0), [response])  # 2+1=
    assert reply.done and reply.messages is None
    assert reply.metrics == {"rubric_exact": exact, "rubric_short": short}
    assert reply.reward == pytest.approx(1.0 * exact + 0.5 * short)
    assert reply.correct == (exact + 0.5 * short >= 1.0)
    assert source.is_correct(source.example("train", 0), response) == reply.correct


@pytest.mark.parametrize("kind, says", [("raise", "raised KeyError: 'answer_key'"), ("nan", "gave exact=nan")])
def test_a_rubric_function_that_raises_or_gives_nan_is_an_error_naming_it(modules, kind, says):
    environment, source = played("vf_sums:broken", {"kind": kind})
    with pytest.raises(RewardError, match=f"function 'exact' of 'vf_sums:broken' {says}"):
        play(environment, source.example("train", 0), ["1"])


# --- multi turn: the Env's run ---------------------------------------------------------------

def test_the_env_answers_each_turn_and_ends_the_episode_when_its_run_does(modules):
    environment, source = played("vf_guess", max_turns=4)
    example = Example(**dataclasses.asdict(source.example("train", 0)))  # secret 7; as a saved rollout reloads it
    replies = play(environment, example, ["3", "9", "7"])
    assert [r.messages for r in replies[:2]] == [[{"role": "user", "content": "higher"}],
                                                  [{"role": "user", "content": "lower"}]]
    assert [r.done for r in replies] == [False, False, True] and replies[2].messages is None
    # found (1 x 1.0) + the run's bonus (1 x 0.5) + finalize's (1 x 0.25), all at the turn that found it
    assert [r.reward for r in replies] == [0.0, 0.0, 1.75]
    assert replies[2].metrics == {"rubric_found": 1.0, "rubric_bonus": 1.0, "rubric_finalized": 1.0}
    assert replies[2].correct is True


def test_at_the_last_turn_the_pending_turn_comes_back_terminated_and_the_run_finishes(modules):
    environment, source = played("vf_guess", max_turns=2)
    replies = play(environment, source.example("train", 0), ["3", "9"])  # secret 7, never found
    assert [r.done for r in replies] == [False, True]
    assert sum(r.reward for r in replies) == 0.25  # only finalize's reward: the run ended, finalize ran
    assert replies[1].correct is False


def test_turn_rewards_add_up_to_the_score_of_the_transcript_where_the_collector_cut_it(modules):
    environment, source = played("vf_guess", max_turns=4)
    replies = play(environment, source.example("train", 1), ["3", "2"])  # secret 2: found at turn 2
    assert [r.reward for r in replies] == [0.0, 1.75]
    replies = play(environment, source.example("train", 1), ["2"])  # found at once
    assert [r.reward for r in replies] == [1.75]


def test_the_envs_message_follows_the_sampled_turn_token_for_token_under_a_chat_template(modules):
    tokenizer = build_char_tokenizer(list(string.printable) + ["<|im_start|>", "<|im_end|>"])
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + "
                               "'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}"
                               "{{ '<|im_start|>assistant\n' }}{% endif %}")
    environment, source = played("vf_guess")
    example = environment.prepare(source.example("train", 0))  # secret 7
    (reply,) = play(environment, example, ["3"])
    observation = observation_ids(reply, tokenizer)
    assert tokenizer.decode(observation) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    prompt = tokenizer.apply_chat_template(example.messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt + "3<|im_end|>", add_special_tokens=False)["input_ids"] + observation
    chat = [*example.messages, {"role": "assistant", "content": "3"}, *reply.messages]
    whole = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ids == tokenizer(whole, add_special_tokens=False)["input_ids"]


# --- tools -----------------------------------------------------------------------------------

def call(name, arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_a_tool_result_comes_back_as_a_tool_message_and_the_tools_are_in_the_system_prompt(modules):
    environment, source = played("vf_calc:make")
    example = environment.prepare(source.example("train", 0))  # what is 2 + 40?
    assert example.messages[0]["role"] == "system" and '"name": "calculator_add"' in example.messages[0]["content"]
    replies = play(environment, source.example("train", 0), [call("calculator_add", {"a": 2, "b": 40}), "42"])
    assert replies[0].messages == [{"role": "tool", "content": "42"}] and not replies[0].done
    assert replies[1].done and replies[1].reward == 1.0
    totals = {name: sum(r.metrics.get(name, 0.0) for r in replies) for name in environment.metric_names}
    assert totals == {"rubric_right": 1.0, "rubric_used_tool": 1.0, "metric_linked": 1.0, "tool_calls": 1.0,
                      "tool_errors": 0.0}


@pytest.mark.parametrize("bad_call, says", [
    ("<tool_call>\n{not json\n</tool_call>", "error: the tool call is not valid JSON"),
    (call("calculator_add", {"a": "two", "b": 40}), "error: wrong arguments for calculator_add: a:"),
    (call("calculator_mul", {"a": 2, "b": 40}), "error: unknown tool 'calculator_mul'"),
])
def test_a_malformed_call_is_an_observation_not_a_crash(modules, bad_call, says):
    environment, source = played("vf_calc:make")
    replies = play(environment, source.example("train", 0), [bad_call, "42"])
    (message,) = replies[0].messages
    assert message["role"] == "tool" and message["content"].startswith(says) and not replies[0].done
    assert replies[0].metrics["tool_errors"] == 1.0 and replies[1].reward == 1.0


# --- start-up --------------------------------------------------------------------------------

def test_a_missing_module_or_function_is_a_config_error_naming_env_load(modules):
    with pytest.raises(ConfigError, match="env.load='no_such_env': no module named 'no_such_env'"):
        VerifiersEnvironment("no_such_env")
    with pytest.raises(ConfigError, match="env.load='vf_calc:nothing': module 'vf_calc' has no function 'nothing'"):
        VerifiersEnvironment("vf_calc:nothing")
    with pytest.raises(ConfigError, match="env.load is not set"):
        VerifiersEnvironment(None)
    with pytest.raises(ConfigError, match="env.args do not fit the taskset config of env.load='vf_sums': cnt: Extra"):
        VerifiersEnvironment("vf_sums", {"cnt": 3})


def test_what_posttrain_cannot_play_is_named(modules):
    with pytest.raises(ConfigError, match="env.load='vf_guess:stopping': @vf.stop hooks are not supported"):
        VerifiersEnvironment("vf_guess:stopping")
    environment, source = played("vf_guess:two_seats")
    with pytest.raises(ConfigError, match="plays a second agent 'user' besides 'agent'"):
        play(environment, source.example("train", 0), ["7"])


def test_data_and_env_verifiers_go_together(make_config):
    with pytest.raises(ConfigError, match="data=verifiers holds a verifiers environment's tasks.*add env=verifiers"):
        check_config(make_config("algorithm=grpo", "data=verifiers"))
    with pytest.raises(ConfigError, match="env.load is not set"):
        check_config(make_config("algorithm=grpo", "data=verifiers", "env=verifiers", "reward=environment"))


def test_two_grpo_steps_through_the_cli_log_each_rubric_function(modules, tmp_path):
    """`posttrain env=verifiers data=verifiers env.load=vf_sums` on the embedded model: two steps,
    the rubric's components in metrics.jsonl."""
    from forked_cli import run_command

    command = [sys.executable, "-m", "posttrain.train", "algorithm=grpo", "env=verifiers", "data=verifiers",
               "env.load=vf_sums", "env.args={count: 12}", "env.max_turns=1", "reward=environment",
               "data.heldout_size=2", "data.chat=false", "data.max_response_tokens=4", "algorithm.warm_start.steps=0",
               "algorithm.prompts_per_step=2", "algorithm.group_size=2", "logger=csv", "callbacks.progress_bar=none",
               "trainer.max_steps=2", "trainer.val_check_interval=2", "eval.num_prompts=2", "eval.batch_size=2",
               "eval.at_start=false", "num_threads=1", f"paths.log_dir={tmp_path}"]
    ran = run_command(command, capture_output=True, text=True, timeout=600,
                      env={**os.environ, "PYTHONPATH": str(modules)})
    assert ran.returncode == 0, ran.stderr[-3000:]
    (metrics_file,) = tmp_path.rglob("metrics.jsonl")
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    steps = [row for row in rows if "episode/rubric_exact" in row]
    assert len(steps) == 2
    for row in steps:  # each a mean over the batch's episodes of a 0/1 score; the return their weighted sum
        assert 0.0 <= row["episode/rubric_exact"] <= 1.0 and 0.0 <= row["episode/rubric_short"] <= 1.0
        assert math.isclose(row["episode/return"], row["episode/rubric_exact"] + 0.5 * row["episode/rubric_short"])
