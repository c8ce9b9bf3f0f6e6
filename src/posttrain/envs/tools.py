"""Tool calls and the built-in tools, in the Hermes convention of Qwen2.5 (and SmolLM2's arrays of calls).

The policy calls a tool by writing a JSON object inside `<tool_call>` tags (one or several per
turn):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3*4"}}
    </tool_call>

or, as SmolLM2's function-calling data writes them, a JSON array of such objects in one block
(`<tool_call>[{"name": ...}, {"name": ...}]</tool_call>`: each element a call; `[]`: none).

and reads each result as a chat message of role "tool" (its chat template renders it). The
system prompt lists the tools as JSON function signatures in a `<tools></tools>` block
(`tools_system_prompt`, Qwen2.5's wording). Nothing the policy writes raises: a call that
cannot run (an unclosed tag, bad JSON, no name, an unknown tool, wrong arguments) is answered
with a short error the policy reads instead of the result.

`ToolEnvironment` runs an episode: each turn's calls are run and answered; a turn without a
call is the final answer (the task's accuracy reward judges it), and the collector stops at
`max_turns` anyway.

    env:
      _target_: posttrain.envs.tools.ToolEnvironment
      tools: [calculator, python]
      max_turns: 4
      call_reward: 0.0
      sandbox: {wall_s: 5.0}    # the python tool's SandboxLimits
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from posttrain.data.examples import Example
from posttrain.data.templates import check_messages
from posttrain.envs.base import Environment, Reply, Turn
from posttrain.envs.sandbox import SandboxLimits, SandboxResult, check_isolation, run_python
from posttrain.errors import ConfigError, DataError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


# --- parsing ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolCall:
    """A well-formed call of a known (or, without a tool list, any) tool."""

    name: str
    arguments: dict
    text: str  # the JSON the policy wrote between the tags


@dataclass(frozen=True)
class MalformedCall:
    """A call that cannot run; `error` is what the policy reads in place of a result."""

    error: str
    text: str  # what the policy wrote after the opening tag (up to the closing one, if any)


def parse_tool_calls(text: str, tools: Iterable[str] | None = None) -> list[ToolCall | MalformedCall]:
    """The `<tool_call>` blocks of `text`, in order. With `tools` (names, or a mapping of them),
    a call of any other name is malformed too. Never raises: text outside the tags, and a stray
    closing tag, are ignored."""
    known = None if tools is None else list(tools)
    calls: list[ToolCall | MalformedCall] = []
    start = text.find(OPEN)
    while start != -1:
        body_start = start + len(OPEN)
        end = text.find(CLOSE, body_start)
        following = text.find(OPEN, body_start)
        if end == -1 or (following != -1 and following < end):
            stop = len(text) if following == -1 else following
            calls.append(MalformedCall(f"error: {OPEN} is not closed by {CLOSE}", text[body_start:stop].strip()))
            start = following
            continue
        calls.extend(_parse_block(text[body_start:end].strip(), known))
        start = text.find(OPEN, end + len(CLOSE))
    return calls


CALL_SHAPE = '{"name": <tool name>, "arguments": {...}}'


def _parse_block(body: str, known: list[str] | None) -> list[ToolCall | MalformedCall]:
    """The calls of one block: a JSON object is one call, a JSON array of objects one call each."""
    if not body:
        return [MalformedCall(f"error: the tool call is empty; write {CALL_SHAPE}", body)]
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return [MalformedCall(f"error: the tool call is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})",
                              body)]
    except RecursionError:
        return [MalformedCall("error: the tool call is not valid JSON (nested too deeply)", body)]
    if isinstance(value, list):  # SmolLM2's convention: the calls of a turn as one array
        return [_parse_call(item, json.dumps(item, ensure_ascii=False), known) for item in value]
    return [_parse_call(value, body, known)]


def _parse_call(call, body: str, known: list[str] | None) -> ToolCall | MalformedCall:
    shape = CALL_SHAPE
    if not isinstance(call, dict):
        return MalformedCall(f"error: the tool call must be a JSON object {shape}, got {_json_type(call)}", body)
    name = call.get("name")
    if not isinstance(name, str) or not name:
        why = "has no" if name is None else "has no string"
        return MalformedCall(f'error: the tool call {why} "name"; write {shape}', body)
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return MalformedCall(f'error: "arguments" must be a JSON object, got {_json_type(arguments)}', body)
    if known is not None and name not in known:
        return MalformedCall(f"error: unknown tool {name!r}; the tools are: {', '.join(known)}", body)
    return ToolCall(name, arguments, body)


def _json_type(value) -> str:
    kinds = ((bool, "a boolean"), (int, "a number"), (float, "a number"), (str, "a string"), (list, "an array"),
             (dict, "an object"))
    return next((kind for cls, kind in kinds if isinstance(value, cls)), "null")


# --- tools -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolOutput:
    """A call's result as the policy reads it, and what the environment counts."""

    text: str
    error: bool = False
    timed_out: bool = False  # the sandbox stopped it at its time limit


class ToolError(Exception):
    """Raised by a tool's `run` for a call that cannot give a result; the message is what the
    policy reads (after "error: ")."""


_SCHEMA_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
                 "object": (dict,), "array": (list,), "null": (type(None),)}


class Tool:
    """The base of every tool: a name, a description and a JSON-schema `parameters` object the
    system prompt shows the policy; subclasses implement `run(**arguments)`, returning the
    result text (or a ToolOutput) and raising ToolError for a call that cannot give one.

    Calling a tool never raises: arguments that do not fit `parameters` (unknown or missing
    names, wrong JSON types) and errors from `run` come back as error text."""

    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}, "required": []}

    def __call__(self, **arguments) -> str:
        return self.invoke(arguments).text

    def invoke(self, arguments: Mapping) -> ToolOutput:
        problem = self.argument_error(arguments)
        if problem is not None:
            return ToolOutput(f"error: {problem}", error=True)
        try:
            output = self.run(**arguments)
        except ToolError as e:
            return ToolOutput(f"error: {e}", error=True)
        except Exception as e:  # a tool's failure is the policy's observation, not the run's end
            return ToolOutput(f"error: {type(e).__name__}: {e}", error=True)
        return output if isinstance(output, ToolOutput) else ToolOutput(str(output))

    def run(self, **arguments) -> str | ToolOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement run(**arguments)")

    def check(self) -> None:
        """Raise a ConfigError when this machine cannot run the tool as configured."""

    def signature(self) -> dict:
        """The tool as a JSON function signature (the system prompt's <tools> entry)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def argument_error(self, arguments: Mapping) -> str | None:
        """Why `arguments` do not fit `parameters`, or None."""
        properties = self.parameters.get("properties", {})
        unknown = [key for key in arguments if key not in properties]
        if unknown:
            expected = ", ".join(properties) or "none"
            return f"{self.name} has no argument {', '.join(map(repr, unknown))} (its arguments: {expected})"
        missing = [key for key in self.parameters.get("required", ()) if key not in arguments]
        if missing:
            return f"{self.name} needs the argument {', '.join(map(repr, missing))}"
        for key, value in arguments.items():
            kind = properties[key].get("type")
            allowed = _SCHEMA_TYPES.get(kind) if isinstance(kind, str) else None
            if allowed is None:
                continue
            if isinstance(value, bool) and bool not in allowed:
                allowed = ()
            if not isinstance(value, allowed):
                return f"{self.name}'s argument {key!r} must be a {kind}, got {_json_type(value)}"
        return None


# --- the calculator --------------------------------------------------------------------------

class Calculator(Tool):
    """Arithmetic on numbers: + - * / // % **, unary signs and parentheses, nothing else
    (names, calls, attributes are refused). Powers and results are bounded, so `9**9**9` is an
    error, not a hang."""

    name = "calculator"
    description = ("Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses. "
                   "Returns the value.")
    parameters = {"type": "object",
                  "properties": {"expression": {"type": "string",
                                                "description": "the expression, e.g. (3 + 4) * 12 / 7"}},
                  "required": ["expression"]}

    MAX_CHARS = 1000        # of an expression
    MAX_BITS = 4096         # of an integer, any intermediate one too (about 1233 decimal digits)

    _BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
    _UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}

    def run(self, expression: str) -> str:
        return format_number(self.evaluate(expression))

    def evaluate(self, expression: str) -> int | float:
        """The value of `expression`; ToolError for anything but bounded arithmetic."""
        text = ascii_operators(expression.strip())
        if not text:
            raise ToolError("the expression is empty")
        if len(text) > self.MAX_CHARS:
            raise ToolError(f"the expression is longer than {self.MAX_CHARS} characters")
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError as e:
            raise ToolError(f"cannot parse {expression!r}: {e.msg}") from None
        except (RecursionError, MemoryError, ValueError):
            raise ToolError(f"cannot parse {expression!r}") from None
        try:
            return self._value(tree.body)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("the result is too large") from None
        except RecursionError:
            raise ToolError("the expression is nested too deeply") from None

    def worked_steps(self, reference: str) -> list[tuple[str, str]]:
        """The arithmetic of a reference solution as calls: each line "expression = value" whose
        expression this calculator evaluates to that value, as (expression, result text), its
        operators written in ASCII (× -> *)."""
        steps = []
        for line in reference.splitlines():
            match = _WORKED_LINE.fullmatch(line.strip())
            if match is None:
                continue
            expression = ascii_operators(match["expression"]).strip()
            try:
                value = self.evaluate(expression)
            except ToolError:
                continue
            if math.isclose(value, float(match["value"])):
                steps.append((expression, format_number(value)))
        return steps

    def _value(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise ToolError(f"only numbers are allowed, not {node.value!r}")
            return self._bounded(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in self._UNARY:
            return self._UNARY[type(node.op)](self._value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in self._BINARY:
            left, right = self._value(node.left), self._value(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            result = self._BINARY[type(node.op)](left, right)
            if isinstance(result, complex):
                raise ToolError("the result is not a real number")
            return self._bounded(result)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
            raise ToolError("^ is not a power here; write ** (2**10)")
        if isinstance(node, ast.Name):
            raise ToolError(f"names are not allowed ({node.id!r}); write numbers only")
        if isinstance(node, ast.Call):
            raise ToolError("function calls are not allowed; write numbers and + - * / // % ** only")
        if isinstance(node, ast.Attribute):
            raise ToolError("attributes are not allowed; write numbers and + - * / // % ** only")
        raise ToolError(f"{ast.unparse(node)!r} is not arithmetic; write numbers and + - * / // % ** only")

    def _check_power(self, base: int | float, exponent: int | float) -> None:
        # an integer power is exact, so too large a one would take long to make: refused
        # before it is computed (a float power overflows at once instead)
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
            if (abs(base).bit_length() - 1) * exponent > self.MAX_BITS:
                raise ToolError("the result is too large")

    def _bounded(self, value: int | float) -> int | float:
        if isinstance(value, int) and value.bit_length() > self.MAX_BITS:
            raise ToolError("the result is too large")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("the result is too large" if math.isinf(value) else "the result is not a number")
        return value


# a line of a worked solution: "12 + 3 × 4 = 24" (an expression with an operator, its value)
_WORKED_LINE = re.compile(r"(?P<expression>[\d.\s()]+(?:[-+*/×÷−][\d.\s()]+)+)=\s*(?P<value>-?\d+(?:\.\d+)?)")


def ascii_operators(text: str) -> str:
    """`text` with the typeset operators a solution may write (× ÷ −) as Python's (* / -)."""
    return text.replace("×", "*").replace("÷", "/").replace("−", "-")


def format_number(value: int | float) -> str:
    """An integer as itself; a float with 12 significant digits, as an integer when it is one
    (12 / 4 -> "3", 1 / 3 -> "0.333333333333", 0.1 + 0.2 -> "0.3")."""
    if isinstance(value, int):
        return str(value)
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.12g}"


# --- the python tool -------------------------------------------------------------------------

class PythonTool(Tool):
    """Runs the policy's code in the sandbox (envs/sandbox.py) and answers with what it printed;
    when the run is not clean, also its stderr and why it stopped (a timeout, the memory limit).
    Each call is a fresh process: nothing persists between calls."""

    name = "python"
    description = ("Run a Python 3 program and return what it prints. Each call is a fresh process (nothing "
                   "persists between calls), without network, with limited time and memory; print what you "
                   "need to see.")
    parameters = {"type": "object",
                  "properties": {"code": {"type": "string", "description": "the program to run"}},
                  "required": ["code"]}

    def __init__(self, limits: SandboxLimits | None = None, max_chars: int = 2000):
        self.limits = limits if limits is not None else SandboxLimits()
        self.max_chars = max_chars  # of the answer the policy reads

    def check(self) -> None:
        check_isolation(self.limits)

    def run(self, code: str) -> ToolOutput:
        result = run_python(code, limits=self.limits)
        return ToolOutput(self.describe(result), error=not result.ok, timed_out=result.status == "timeout")

    def describe(self, result: SandboxResult) -> str:
        """What the policy reads for a sandbox run: stdout (its start), then for a run that is not
        clean stderr (its end: a traceback's last lines say most) and why it stopped: the
        sandbox's own last "[sandbox] ..." line when it wrote one. The same run reads the same
        (an episode rebuilt by replaying its turns must get the same replies): no measured times,
        and the run's private directory is cut from the paths (File "main.py", line 1)."""
        stdout = _private_paths(result.stdout.rstrip("\n"))
        if result.ok:
            text = _clip(stdout, self.max_chars, keep="head") if stdout else "(no output)"
            return text + ("\n[output cut at the sandbox's limit]" if result.truncated else "")
        stderr = _private_paths(result.stderr.rstrip("\n"))
        *rest, last = stderr.rsplit("\n", 1) if stderr else [""]
        if last.startswith("[sandbox]"):
            status, stderr = last, "".join(rest).rstrip("\n")
        else:
            status = f"[{self.stopped(result)}]"
        budget = max(self.max_chars - len(status) - 10, 0)
        parts = []
        if stdout:
            parts.append(_clip(stdout, budget // 2 if stderr else budget, keep="head"))
        if stderr:
            parts.append(_clip(stderr, budget - (len(parts[0]) if parts else 0), keep="tail"))
        parts.append(status)
        return "\n".join(parts)

    def stopped(self, result: SandboxResult) -> str:
        """Why a run that is not clean stopped, from its status (the limits, not the times measured)."""
        limits = self.limits
        return {
            "timeout": f"timeout (limits: {limits.cpu_s:g} s CPU, {limits.wall_s:g} s wall)",
            "memory": f"out of memory (limit {limits.memory_mb} MB)",
            "output_limit": f"the output passed its limit of {limits.output_bytes} bytes",
            "killed": f"killed (exit status {result.returncode})",
            "refused": "the sandbox refused to run the program",
            "error": f"exit status {result.returncode}",
        }.get(result.status, f"{result.status} (exit status {result.returncode})")


# the directory a sandbox run's files live in (a fresh temporary one each run): cut from what the
# policy reads, so that a traceback names "main.py" and the same run reads the same
_PRIVATE_DIRECTORY = re.compile(r"/[^\s\"']*?posttrain-sandbox-[^/\s\"']+/work/")


def _private_paths(text: str) -> str:
    return _PRIVATE_DIRECTORY.sub("", text)


def _clip(text: str, limit: int, keep: str) -> str:
    if len(text) <= limit:
        return text
    mark = "[...]"
    room = max(limit - len(mark) - 1, 0)
    return f"{text[:room]}\n{mark}" if keep == "head" else f"{mark}\n{text[len(text) - room:]}"


# --- the system prompt -----------------------------------------------------------------------

def format_tool_call(name: str, arguments: Mapping) -> str:
    """One call as the policy writes it (what `parse_tool_calls` reads back)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': dict(arguments)}, ensure_ascii=False)}\n{CLOSE}"


def tools_system_prompt(tools: Sequence[Tool]) -> str:
    """The system-prompt text describing `tools`, in Qwen2.5's wording (the Hermes function-calling
    convention): a <tools> block of JSON signatures, and how to call them."""
    signatures = "\n".join(json.dumps(tool.signature(), ensure_ascii=False) for tool in tools)
    return ("# Tools\n\n"
            "You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}\n\n'
            "Each result comes back in a message from the tool. A reply without a tool call is your final answer.")


def with_system_text(messages: Sequence[Mapping], text: str) -> list[dict]:
    """A copy of the chat `messages` whose system message ends with `text` (after its own text,
    once); without a system message, one holding `text` goes first."""
    messages = [dict(m) for m in messages]
    if messages and messages[0].get("role") == "system":
        if text not in messages[0]["content"]:
            own = messages[0]["content"].rstrip()
            messages[0]["content"] = f"{own}\n\n{text}" if own else text
    else:
        messages.insert(0, {"role": "system", "content": text})
    return messages


# --- the environment -------------------------------------------------------------------------

TOOLS = {"calculator": Calculator, "python": PythonTool}


class ToolEnvironment(Environment):
    """Episodes in which the policy may call tools (by name from TOOLS) before its final answer.

    Each turn's calls are run and answered with one "tool" message each; a turn's reward is
    `call_reward` times the share of its calls that ran without error (0 by default: the final
    answer's accuracy is what counts). A turn without a call ends the episode. Calls written in
    the last turn `max_turns` allows are not run (nothing would read their results).

    Metrics per turn: tool_calls, tool_errors (malformed calls, bad arguments, failed runs),
    sandbox_timeouts."""

    name = "tools"  # replies are chat messages: for a real tokenizer with a chat template
    metric_names = ("tool_calls", "tool_errors", "sandbox_timeouts")

    def __init__(self, tools: Sequence[str] = ("calculator",), max_turns: int = 4, call_reward: float = 0.0,
                 sandbox: Mapping | None = None, demonstration: Sequence[Mapping] | None = None):
        super().__init__(max_turns)
        names = [tools] if isinstance(tools, str) else list(tools)
        if not names:
            raise ConfigError(f"env.tools is empty; choose among: {', '.join(TOOLS)}")
        for name in names:
            if name not in TOOLS:
                raise ConfigError(f"env.tools: unknown tool {name!r}; the tools are: {', '.join(TOOLS)}")
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ConfigError(f"env.tools names {', '.join(repeated)} more than once")
        if isinstance(call_reward, bool) or not isinstance(call_reward, (int, float)) or not math.isfinite(call_reward):
            raise ConfigError(f"env.call_reward must be a finite number, got {call_reward!r}")
        self.call_reward = float(call_reward)
        self.limits = sandbox_limits(sandbox)
        self.tools: dict[str, Tool] = {name: PythonTool(self.limits) if TOOLS[name] is PythonTool else TOOLS[name]()
                                       for name in names}
        self.system_prompt = tools_system_prompt(list(self.tools.values()))
        # a worked exchange shown before the example's own turns (a model that has never seen the
        # call format may otherwise never write one, and GRPO reinforces only what it samples)
        try:
            self.demonstration = check_messages(list(demonstration or []), "env.demonstration") if demonstration else []
        except DataError as err:
            raise ConfigError(str(err)) from None

    def prepare(self, example: Example) -> Example:
        """The example as a chat whose system message describes the tools: the example's own
        system message gets the tools' text after it; without one, a system message is put first.
        A prompt without messages becomes a user message. `prompt` and `answer` are kept; a
        truncated prompt's ids are dropped (they were the old chat's)."""
        messages = with_system_text(example.messages if example.messages is not None else
                                    [{"role": "user", "content": example.prompt}], self.system_prompt)
        if self.demonstration and messages[1:1 + len(self.demonstration)] != self.demonstration:
            messages[1:1] = [dict(m) for m in self.demonstration]
        return dataclasses.replace(example, messages=messages, prompt_ids=None)

    def start(self, example: Example) -> ToolEpisode:
        return ToolEpisode(self, example)

    def worked_episode(self, example: Example) -> list[dict] | None:
        """With the calculator: the reference solution's arithmetic lines (`Calculator.worked_steps`)
        as calls, one per turn while turns last (the rest together in the last turn that may call),
        each answered by the calculator's result, then the reference response as the final answer.
        None when the reference has no such line (or the calculator is not among the tools)."""
        calculator = self.tools.get("calculator")
        steps = calculator.worked_steps(example.response) if calculator is not None else []
        if not steps or self.max_turns < 2:
            return None
        call_turns = min(len(steps), self.max_turns - 1)
        turns = [[step] for step in steps[:call_turns - 1]] + [steps[call_turns - 1:]]
        messages = []
        for turn in turns:
            messages.append({"role": "assistant", "content": "\n".join(
                format_tool_call("calculator", {"expression": expression}) for expression, _ in turn)})
            messages += [{"role": "tool", "content": result} for _, result in turn]
        return messages + [{"role": "assistant", "content": example.response}]

    def check(self) -> None:
        for tool in self.tools.values():
            tool.check()


def sandbox_limits(sandbox: Mapping | None) -> SandboxLimits:
    """SandboxLimits from the `env.sandbox` mapping (keys: its fields); a ConfigError names an
    unknown key and the choices."""
    if sandbox is None:
        return SandboxLimits()
    if not isinstance(sandbox, Mapping):
        raise ConfigError(f"env.sandbox must be a mapping of SandboxLimits fields, got {sandbox!r}")
    fields = [field.name for field in dataclasses.fields(SandboxLimits)]
    for key in sandbox:
        if key not in fields:
            raise ConfigError(f"env.sandbox: unknown key {key!r}; the keys are: {', '.join(fields)}")
    try:
        return SandboxLimits(**{key: sandbox[key] for key in sandbox})
    except (TypeError, ValueError) as err:
        raise ConfigError(f"env.sandbox: {err}") from None


class ToolEpisode:
    """One episode of a ToolEnvironment (see there)."""

    def __init__(self, env: ToolEnvironment, example: Example):
        self.env = env
        self.example = example

    def step(self, turn: Turn) -> Reply:
        calls = parse_tool_calls(turn.text, self.env.tools)
        if not calls or turn.index + 1 >= self.env.max_turns:
            return Reply(done=True)
        outputs = [ToolOutput(call.error, error=True) if isinstance(call, MalformedCall)
                   else self.env.tools[call.name].invoke(call.arguments) for call in calls]
        errors = sum(output.error for output in outputs)
        return Reply(reward=self.env.call_reward * (len(outputs) - errors) / len(outputs),
                     messages=[{"role": "tool", "content": output.text} for output in outputs],
                     metrics={"tool_calls": float(len(outputs)), "tool_errors": float(errors),
                              "sandbox_timeouts": float(sum(output.timed_out for output in outputs))})
