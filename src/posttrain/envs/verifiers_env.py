"""`env=verifiers`: an environment written for `verifiers` 0.4.0 trains under posttrain.

    posttrain env=verifiers data=verifiers env.load=mypackage.my_env reward=environment

verifiers runs a policy through a harness program that calls a model server; posttrain plays
that part itself, in process and token in / token out: the collector samples each policy turn,
this adapter hands the turn's text to the verifiers side as the assistant message, and what the
verifiers side answers (a user message from the Env's `run`, tool results) comes back as the chat
messages posttrain appends as tokens.

What runs, per episode (`VerifiersEpisode`):

- the environment's `Env.run(task, agents)` (verifiers' `SingleAgentEnv` for a bare taskset: one
  segment) as a coroutine on the environment's event loop, driven turn by turn. Its `agents.<seat>`
  is the policy (`PolicySeat`): `run(task)` plays one segment, `interaction(task)` opens an
  exchange whose `turn(message)` sends the environment's message and returns the policy's
  `Segment`. A segment lasts while the policy calls tools: each call (Hermes `<tool_call>` JSON,
  as envs/tools.py reads it) runs the tool in process and its result is a `tool` message; a
  malformed call or failing tool is answered with an error message, never a crash. The turn
  without a call ends the segment.
- the rubric: each `@vf.reward` function of the task (and each reward the Env records on the trace
  with `record_reward`) scores the transcript so far after every policy turn. A turn's reward is
  the change of the weighted sum, so the turns' rewards add up to the rubric's score of the episode
  as it ended, wherever the collector cut it. Each function's unweighted score is reported as
  `rubric_<name>` (logged as `episode/rubric_<name>`), each `@vf.metric` as `metric_<name>`.
- the verdict (`eval/accuracy`): the weighted sum >= `correct_threshold`.
- when posttrain will ask no more turns (`max_turns`), the seat's pending turn comes back
  `terminated` (as verifiers' own turn limit does), so `run` ends and `Env.finalize` runs.

Not supported (refused at start-up where it can be seen, else an error naming it): judge rubrics
(`TaskConfig.judges`), rewards or tasks that need a runtime (sandboxes, containers), several agent
seats, `Interaction.send/steer`, tasks without a prompt, `@vf.stop` hooks, toolset state and
per-task toolset setup.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import math
import threading
from collections.abc import Mapping

from posttrain.data.examples import Example
from posttrain.data.verifiers_source import (VerifiersSource, import_verifiers, load_verifiers_environment,
                                             task_from_example)
from posttrain.envs.base import Environment, Reply, Turn
from posttrain.envs.tools import (MalformedCall, Tool, ToolOutput, parse_tool_calls, tools_system_prompt,
                                  with_system_text)
from posttrain.errors import ConfigError, DataError, RewardError

CUT = object()  # what a seat's pending turn receives when posttrain asks for no more turns


# --- tools -----------------------------------------------------------------------------------

class VerifiersTool(Tool):
    """A `@vf.tool` method of a verifiers Toolset, called in process (not through MCP)."""

    def __init__(self, name: str, method):
        import pydantic  # optional: verifiers' dependency

        self.name, self.method = name, method
        self.description = (method.__doc__ or "").strip()
        fields = {}
        for parameter in inspect.signature(method).parameters.values():
            annotation = object if parameter.annotation is inspect.Parameter.empty else parameter.annotation
            default = ... if parameter.default is inspect.Parameter.empty else parameter.default
            fields[parameter.name] = (annotation, default)
        self.arguments_model = pydantic.create_model(f"{name}_arguments", **fields)
        schema = self.arguments_model.model_json_schema()
        self.parameters = {"type": "object", "properties": {
            key: {k: v for k, v in value.items() if k != "title"} for key, value in schema.get("properties", {}).items()},
            "required": schema.get("required", [])}

    async def call(self, arguments: Mapping) -> ToolOutput:
        import pydantic  # optional: verifiers' dependency

        try:
            checked = self.arguments_model.model_validate(dict(arguments))
        except pydantic.ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in err.errors())
            return ToolOutput(f"error: wrong arguments for {self.name}: {problems}", error=True)
        try:
            result = self.method(**{key: getattr(checked, key) for key in type(checked).model_fields})
            if inspect.isawaitable(result):
                result = await result
        except Exception as err:  # a tool's failure is the policy's observation, not the run's end
            return ToolOutput(f"error: {type(err).__name__}: {err}", error=True)
        return ToolOutput(result if isinstance(result, str) else json.dumps(result, default=str))


def toolset_tools(toolsets) -> dict[str, VerifiersTool]:
    """The `@vf.tool` methods of the toolsets, by the names verifiers advertises them under
    (`<server name>_<tool>`, or bare with `TOOL_PREFIX = None`)."""
    from verifiers.v1.utils.decorators import discover_decorated  # optional: the verifiers extra

    tools: dict[str, VerifiersTool] = {}
    for toolset in toolsets:
        prefix = toolset.server_name
        for method in discover_decorated(toolset, "tool"):
            bare = getattr(method, "tool_name", None) or method.__name__
            name = f"{prefix}_{bare}" if prefix else bare
            if name in tools:
                raise ConfigError(f"two verifiers tools are named {name!r}; give one toolset a distinct TOOL_PREFIX")
            tools[name] = VerifiersTool(name, method)
    return tools


# --- the environment -------------------------------------------------------------------------

class VerifiersEnvironment(Environment):
    """A verifiers 0.4.0 environment (see the module's docstring), loaded from `load` with `args`."""

    name = "verifiers"

    def __init__(self, load: str | None = None, args: Mapping | None = None, max_turns: int = 4,
                 correct_threshold: float = 1.0):
        super().__init__(max_turns)
        self.vf = import_verifiers()
        self.loaded = load_verifiers_environment(load, args)
        if isinstance(correct_threshold, bool) or not isinstance(correct_threshold, (int, float)):
            raise ConfigError(f"env.correct_threshold must be a number, got {correct_threshold!r}")
        self.correct_threshold = float(correct_threshold)
        self.taskset = self.loaded.taskset
        self.task_type = type(self.taskset).task_type()
        self.loops = threading.local()  # an event loop per thread that plays episodes (a producer thread has its own)
        probe = next(iter(self.taskset.take(1)), None)
        if probe is None:
            raise ConfigError(f"env.load={load!r}: the taskset has no tasks")
        self.check_supported(probe)
        self.tools = toolset_tools([*self.task_type.toolsets(self.taskset.config.task),
                                    *type(self.taskset).toolsets(self.taskset.config)])
        self.system_prompt = tools_system_prompt(list(self.tools.values())) if self.tools else None
        self.metric_names = (*(f"rubric_{fn.__name__}" for fn in probe.hooks("reward")),
                             *(f"metric_{fn.__name__}" for fn in probe.hooks("metric")),
                             *(("tool_calls", "tool_errors") if self.tools else ()))

    def check_supported(self, task) -> None:
        where = f"env.load={self.loaded.load!r}"
        if task.config.judges:
            raise ConfigError(f"{where}: judge rubrics (TaskConfig.judges: a model grades the answer) are not "
                              f"supported under posttrain; score with @vf.reward functions")
        if getattr(task, "NEEDS_CONTAINER", False):
            raise ConfigError(f"{where}: its tasks need a container (Task.NEEDS_CONTAINER), which posttrain does not run")
        for kind in ("reward", "metric"):
            for fn in task.hooks(kind):
                parameter = inspect.signature(fn).parameters.get("runtime")
                if parameter is not None and parameter.default is inspect.Parameter.empty:
                    raise ConfigError(f"{where}: @vf.{kind} {fn.__name__!r} needs a runtime (a sandbox or container), "
                                      f"which posttrain does not run")
        if task.hooks("stop"):
            raise ConfigError(f"{where}: @vf.stop hooks are not supported; end an episode from the Env's run, or with "
                              f"env.max_turns")

    def prepare(self, example: Example) -> Example:
        """With tools: the example's system message describes them (after its own text)."""
        if self.system_prompt is None or example.messages is None:
            return example
        return dataclasses.replace(example, messages=with_system_text(example.messages, self.system_prompt),
                                   prompt_ids=None)

    def start(self, example: Example) -> VerifiersEpisode:
        return VerifiersEpisode(self, example)

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """This thread's loop, on which its episodes' runs wait between turns."""
        loop = getattr(self.loops, "loop", None)
        if loop is None:
            loop = self.loops.loop = asyncio.new_event_loop()
            loop.set_exception_handler(quiet_about_dropped_episodes)
        return loop

    def attach(self, source) -> None:
        if not isinstance(source, VerifiersSource):
            raise ConfigError(f"env=verifiers plays the tasks of data=verifiers, not of {type(source).__name__}: "
                              f"set data=verifiers (it reads the tasks of env.load)")
        if source.loaded is not self.loaded:
            raise ConfigError(f"data=verifiers reads {source.loaded.load!r} but env.load={self.loaded.load!r}; "
                              f"leave data.load and data.args to follow env.load and env.args")
        source.verifier = self.is_correct

    def is_correct(self, example: Example, response: str) -> bool:
        """The verdict on `response` as the episode's only turn."""
        reply = self.start(self.prepare(example)).step(Turn(response, [], True, self.max_turns - 1))
        return bool(reply.correct)


# --- an episode ------------------------------------------------------------------------------

class VerifiersEpisode:
    """One task played: the Env's `run` as a coroutine, resumed at each policy turn."""

    def __init__(self, env: VerifiersEnvironment, example: Example):
        vf = env.vf
        from verifiers.v1.trace import AgentInfo, TraceTask  # optional: the verifiers extra

        self.env, self.vf = env, vf
        self.task = task_from_example(env.taskset, example)
        self.trace = vf.Trace(task=TraceTask(type=type(self.task).__name__, data=self.task.data, key=self.task.key,
                                             hash=self.task.hash), agent=AgentInfo(config=vf.AgentConfig()))
        for message in example.messages or [{"role": "user", "content": example.prompt}]:
            self.add(vf.UserMessage(content=message["content"]) if message["role"] == "user"
                     else vf.SystemMessage(content=message["content"]))
        self.seats = PolicySeats(self)
        self.asked: asyncio.Future | None = None  # the seat's pending turn, answered by `step`
        self.asking = asyncio.Event()
        self.cut = False                           # posttrain asks for no more turns
        self.reply_start = len(self.trace.nodes)   # the first node after the policy's last message
        self.reported: dict[str, float] = {}       # the scores earlier replies reported (their sum)
        self.reported_total = 0.0                  # the weighted sum earlier replies reported
        self.counts = {"tool_calls": 0.0, "tool_errors": 0.0}
        self.loop = env.event_loop()
        self.run = self.loop.create_task(self.play())
        self.drive()

    def add(self, message, sampled: bool = False) -> None:
        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(self.vf.MessageNode(parent=parent, message=message, sampled=sampled))

    async def play(self) -> None:
        env = self.env.loaded.env
        if env is None:  # a bare taskset: one agent, one segment (verifiers' SingleAgentEnv)
            await self.seats.agent.run(self.task)
            return
        await env.setup(self.seats)
        await env.run(self.task, self.seats)
        episode = self.vf.Episode(env=self.vf.EnvInfo(id=getattr(env.config, "env_id", "") or ""),
                                  task=self.trace.task, traces=[self.trace])
        await env.finalize(self.task, episode)

    async def policy_turn(self):
        """The policy's next turn's text (or CUT), as `step` gives it."""
        if self.cut:
            return CUT
        self.asked = self.loop.create_future()
        self.asking.set()
        return await self.asked

    async def until_asked_or_over(self) -> None:
        waiter = asyncio.ensure_future(self.asking.wait())
        try:
            await asyncio.wait({self.run, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()

    def drive(self) -> None:
        """Run the environment until it waits for the policy's turn or its run is over."""
        self.asking.clear()
        self.loop.run_until_complete(self.until_asked_or_over())
        if self.run.done() and self.run.exception() is not None:
            error = self.run.exception()
            if isinstance(error, (ConfigError, RewardError)):
                raise error
            raise DataError(f"the verifiers environment {self.env.loaded.load!r} raised in its run: "
                            f"{type(error).__name__}: {error}") from error

    def answer(self, value) -> None:
        asked, self.asked = self.asked, None
        asked.set_result(value)
        self.drive()

    def step(self, turn: Turn) -> Reply:
        if self.asked is not None:
            self.answer(turn.text)
        if turn.index + 1 >= self.env.max_turns:  # posttrain asks no more: a pending turn ends the exchange
            self.cut = True
            while self.asked is not None:
                self.answer(CUT)
        done = self.run.done()
        observation = [] if done else [as_chat(node.message) for node in self.trace.nodes[self.reply_start:]]
        total, scores = self.loop.run_until_complete(self.score())
        metrics = {**scores, **(self.counts if self.env.tools else {})}
        # each reply reports the change, so the episode's sums are the scores of its transcript as it ended
        changes = {name: value - self.reported.get(name, 0.0) for name, value in metrics.items()}
        reward = total - self.reported_total
        self.reported, self.reported_total = metrics, total
        return Reply(reward=reward, done=done, messages=observation or None,
                     correct=total >= self.env.correct_threshold, metrics=changes)

    async def score(self) -> tuple[float, dict[str, float]]:
        """(the weighted sum, each reward's unweighted score as rubric_<name> and each metric as
        metric_<name>) of the transcript so far: the task's @vf.reward and @vf.metric functions,
        and the rewards the Env recorded on the trace."""
        from verifiers.v1.utils.decorators import invoke  # optional: the verifiers extra

        available = {"task": self.task.data, "trace": self.trace}
        weighted = {name: (reward.score, reward.weight) for name, reward in self.trace.rewards.items()
                    if reward is not None}  # recorded by the Env's run or finalize
        metrics: dict[str, float] = {}
        for kind in ("reward", "metric"):
            for fn in self.task.hooks(kind):
                try:
                    result = invoke(fn, available)
                    if inspect.isawaitable(result):
                        result = await result
                except Exception as err:
                    raise RewardError(f"the verifiers {kind} function {fn.__name__!r} of {self.env.loaded.load!r} "
                                      f"raised {type(err).__name__}: {err}") from err
                items = result.items() if isinstance(result, Mapping) else [(fn.__name__, result)]
                for name, value in items:
                    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                        raise RewardError(f"the verifiers {kind} function {fn.__name__!r} of {self.env.loaded.load!r} "
                                          f"gave {name}={value!r}; expected a finite number")
                    if kind == "reward":
                        weighted[name] = (float(value), float(getattr(fn, "_vf_weight", 1.0)))
                    else:
                        metrics[f"metric_{name}"] = float(value)
        total = sum(score * weight for score, weight in weighted.values())
        return total, {**{f"rubric_{name}": score for name, (score, _) in weighted.items()}, **metrics}


def quiet_about_dropped_episodes(loop, context) -> None:
    """An episode the collector stops reading before its run is over (the episode's token budget
    spent) is dropped with its run still waiting for a turn; that is expected, not an error."""
    if "Task was destroyed but it is pending" not in context.get("message", ""):
        loop.default_exception_handler(context)


def as_chat(message) -> dict:
    """A verifiers message as the chat message posttrain renders."""
    content = message.content if isinstance(message.content, str) else "".join(
        getattr(part, "text", "") or "" for part in message.content or ())
    return {"role": message.role, "content": content}


# --- the policy as verifiers' agent ----------------------------------------------------------

class PolicySeats:
    """verifiers' `Agents` as an Env's run sees them: `agents.<seat>`, one seat, played by the policy."""

    def __init__(self, episode: VerifiersEpisode):
        self._episode = episode
        self._seats: dict[str, PolicySeat] = {}

    def __getattr__(self, name: str) -> PolicySeat:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._seats:
            self._seats[name] = PolicySeat(name, self._episode, self)
        return self._seats[name]

    def claim(self, seat: PolicySeat) -> None:
        """`seat` plays: the policy is one seat, and a trainable one."""
        others = [name for name, other in self._seats.items() if other is not seat and other.played]
        if others:
            raise ConfigError(f"the verifiers environment {self._episode.env.loaded.load!r} plays a second agent "
                              f"{seat.name!r} besides {others[0]!r}: posttrain plays one agent seat, the policy")
        if not seat.trainable:
            raise ConfigError(f"the verifiers environment {self._episode.env.loaded.load!r} plays agent {seat.name!r}, "
                              f"which its setup marks untrainable: posttrain plays one trainable seat, the policy")
        seat.played = True


class PolicySeat:
    """One agent seat of verifiers' `Agents`: `run(task)` and `interaction(task)`."""

    def __init__(self, name: str, episode: VerifiersEpisode, seats: PolicySeats):
        self.name, self.episode, self.seats = name, episode, seats
        self.trainable, self.played = True, False

    async def run(self, task):
        async with self.interaction(task) as exchange:
            await exchange.turn()
        return self.episode.trace

    @contextlib.asynccontextmanager
    async def interaction(self, task):
        self.seats.claim(self)
        if task.data.prompt is None:
            raise ConfigError(f"the verifiers environment {self.episode.env.loaded.load!r} opens an interaction on a "
                              f"task without a prompt: posttrain starts each episode from its task's prompt")
        self.episode.task = task  # the task it scores (an Env may hand the seat a changed copy)
        yield PolicyInteraction(self)

    async def segment(self):
        """The policy's turns until one calls no tool (`terminated` when posttrain asks no more)."""
        vf, episode = self.episode.vf, self.episode
        produced = []
        while True:
            text = await episode.policy_turn()
            if text is CUT:
                return vf.Segment(messages=[], terminated=True)
            calls = parse_tool_calls(text, episode.env.tools) if episode.env.tools else []
            ids = [f"call_{episode.trace.num_turns}_{n}" for n in range(len(calls))]  # a call's id names its result
            assistant = vf.AssistantMessage(content=text, tool_calls=[
                vf.ToolCall(id=call_id, name=call.name, arguments=json.dumps(call.arguments))
                for call_id, call in zip(ids, calls) if not isinstance(call, MalformedCall)] or None)
            episode.add(assistant, sampled=True)
            episode.reply_start = len(episode.trace.nodes)
            produced.append(assistant)
            if not calls:
                return vf.Segment(messages=produced)
            for call_id, call in zip(ids, calls):
                if isinstance(call, MalformedCall):
                    output, name = ToolOutput(call.error, error=True), None
                else:
                    output, name = await episode.env.tools[call.name].call(call.arguments), call.name
                episode.counts["tool_calls"] += 1
                episode.counts["tool_errors"] += float(output.error)
                message = vf.ToolMessage(tool_call_id=call_id, content=output.text, name=name)
                episode.add(message)
                produced.append(message)


class PolicyInteraction:
    """verifiers' `Interaction`: the Env's run is the user, the policy answers each `turn`."""

    def __init__(self, seat: PolicySeat):
        self.seat = seat
        self.started = self.over = False

    @property
    def trace(self):
        return self.seat.episode.trace

    async def turn(self, message=None):
        vf, episode = self.seat.episode.vf, self.seat.episode
        if self.over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        if not self.started and message is not None:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        if self.started and message is None:
            raise ValueError("nothing to run a turn on: this exchange takes its next user message")
        self.started = True
        if isinstance(message, str):
            episode.add(vf.UserMessage(content=message))
        elif message is not None:
            for item in message:
                role, content = (item["role"], item["content"]) if isinstance(item, dict) else (item.role, item.content)
                episode.add(vf.UserMessage(content=content) if role == "user" else vf.SystemMessage(content=content))
        segment = await self.seat.segment()
        self.over = segment.terminated
        return segment

    async def send(self, *args, **kwargs):
        raise ConfigError("verifiers' Interaction.send (messages during a turn) is not supported under posttrain")

    steer = send

    async def close(self):
        return self.trace
