"""The tasks of a `verifiers` environment as data (`data=verifiers`, played by `env=verifiers`).

verifiers 0.4.0 (`import verifiers.v1 as vf`) splits an environment into a `Taskset` (its
`load()` yields `Task`s: each a `TaskData` with a `prompt` and optional `system_prompt`, plus
the task's own fields) and, optionally, an `Env` subclass whose `run(task, agents)` plays the
turns. `load_verifiers_environment` finds one from `env.load`:

    mypackage.my_env               a module exporting its Taskset subclass (and, optionally, its Env
                                   subclass) in `__all__`, as verifiers' own packages do; `env.args`
                                   are fields of the taskset's config
    mypackage.my_env               ... or a module with a `load_environment(**env.args)` function
    mypackage.my_env:make          a function called with `**env.args`

The function returns a `vf.Env` or a `vf.Taskset`. Loading is cached per (load, args), so the
data source and the environment of one process share the same objects.

An `Example` of the source:

    prompt     the task's system prompt and prompt as text (without `data.chat`)
    messages   [system,] user: the task's prompt as chat messages (with `data.chat`)
    response   "" (verifiers tasks carry no reference solution)
    answer     the task's wire data as JSON (what verifiers writes in a trace's `task.data`): the
               environment rebuilds the task from it, and its rubric judges (`env=verifiers`).
               A plain field, so an example saved with a partial rollout comes back whole.

Splits: the tasks in `load()` order (the first `data.limit` of them; an infinite taskset needs
`data.limit`): the first `data.heldout_size` are the validation split, the next
`data.heldout_size` the test split, the rest the training split.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from posttrain.data.examples import Example, ListSource
from posttrain.errors import ConfigError

PACKAGE = "verifiers==0.4.0"
INSTALL = "pip install 'posttrain[verifiers]' (or pip install verifiers==0.4.0)"


def import_verifiers():
    """`verifiers.v1`, or a ConfigError saying how to install it."""
    try:
        # optional: the verifiers extra
        import verifiers.v1 as vf
    except ImportError as err:
        raise ConfigError(f"env=verifiers and data=verifiers need the verifiers package ({err}); {INSTALL}") from None
    return vf


@dataclass
class LoadedEnvironment:
    """A verifiers environment as loaded: its Env (None for a bare Taskset, played by one agent) and its taskset."""

    load: str
    env: object | None
    taskset: object


_LOADED: dict[str, LoadedEnvironment] = {}


def load_verifiers_environment(load: str | None, args: Mapping | None, key: str = "env.load") -> LoadedEnvironment:
    """The verifiers environment `load` names (see the module's docstring), built with `args`;
    a ConfigError naming `key` when it cannot be found or is not one."""
    vf = import_verifiers()
    if not isinstance(load, str) or not load.strip():
        raise ConfigError(f"{key} is not set: name your verifiers environment, {key}=<module> (exporting its Taskset, "
                          f"or with load_environment) or {key}=<module:function>")
    args = dict(args or {})
    cache_key = json.dumps([load, args], sort_keys=True, default=repr)
    if cache_key in _LOADED:
        return _LOADED[cache_key]
    module_name, _, function_name = load.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and module_name.startswith(err.name):
            raise ConfigError(f"{key}={load!r}: no module named {module_name!r} (install the environment's package, "
                              f"or put its directory on PYTHONPATH)") from None
        raise
    if function_name:
        function = getattr(module, function_name, None)
        if not callable(function):
            raise ConfigError(f"{key}={load!r}: module {module_name!r} has no function {function_name!r}")
        loaded = _call(function, args, f"{key}={load!r}")
    elif callable(getattr(module, "load_environment", None)):
        loaded = _call(module.load_environment, args, f"{key}={load!r} (its load_environment)")
    else:
        import pydantic  # optional: verifiers' dependency

        try:
            config = vf.resolve_env_config({"taskset": {"id": module_name, **args}})
        except pydantic.ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'][1:]))}: {e['msg']}" for e in err.errors())
            raise ConfigError(f"env.args do not fit the taskset config of {key}={load!r}: {problems}") from None
        except (AttributeError, TypeError, ValueError) as err:  # no Taskset exported in __all__, or several
            raise ConfigError(f"{key}={load!r}: not a verifiers environment package ({err})") from None
        loaded = vf.load_environment(config)
    if isinstance(loaded, vf.Env):
        result = LoadedEnvironment(load, loaded, loaded.taskset)
    elif isinstance(loaded, vf.Taskset):
        result = LoadedEnvironment(load, None, loaded)
    else:
        raise ConfigError(f"{key}={load!r} gave a {type(loaded).__name__}; expected a verifiers.v1 Env or Taskset")
    _LOADED[cache_key] = result
    return result


def _call(function: Callable, args: dict, where: str):
    try:
        return function(**args)
    except TypeError as err:
        raise ConfigError(f"{where}: {err} (its arguments come from env.args)") from None


def task_from_example(taskset, example: Example):
    """The verifiers Task an example of VerifiersSource was made from, rebuilt from its wire data (its answer)."""
    try:
        wire = json.loads(example.answer) if example.answer is not None else None
    except json.JSONDecodeError:
        wire = None
    if not isinstance(wire, dict):
        raise ConfigError("env=verifiers plays the tasks of data=verifiers; this example comes from another source "
                          "(set data=verifiers)")
    task_type = type(taskset).task_type()
    return task_type(task_type.data_type().model_validate(wire), taskset.config.task)


class VerifiersSource(ListSource):
    """The tasks of a verifiers environment's taskset, in three splits (see the module's docstring).
    Correctness is the environment's verdict: `verifier` is attached by env=verifiers."""

    def __init__(self, loaded: LoadedEnvironment, limit: int | None = None, heldout_size: int = 8, chat: bool = True):
        super().__init__()
        if not isinstance(chat, bool):
            raise ConfigError(f"data.chat={chat!r} must be true or false")
        self.loaded, self.chat = loaded, chat
        self.step_rule = None
        self.verifier: Callable[[Example, str], bool] | None = None
        taskset = loaded.taskset
        if limit is None and not taskset.bounded:
            raise ConfigError(f"data.limit is null, but the taskset of {loaded.load!r} is infinite: set data.limit "
                              f"(the tasks to read)")
        tasks = list(taskset if limit is None else taskset.take(limit))
        train = len(tasks) - 2 * heldout_size
        if train < 1:
            raise ConfigError(f"the taskset of {loaded.load!r} has {len(tasks)} tasks (data.limit={limit}), and "
                              f"data.heldout_size={heldout_size} holds out {2 * heldout_size} of them (validation and "
                              f"test): none is left to train on; lower data.heldout_size")
        splits = {"validation": tasks[:heldout_size], "test": tasks[heldout_size:2 * heldout_size],
                  "train": tasks[2 * heldout_size:]}
        for split, chosen in splits.items():
            self.examples[split] = [self._example(task) for task in chosen]
            self.origins[split] = [f"{loaded.load} task {task.data.idx}" for task in chosen]

    def _example(self, task) -> Example:
        data = task.data
        if data.prompt is None:
            raise ConfigError(f"task {data.idx} of {self.loaded.load!r} has no prompt (its environment opens the "
                              f"conversation): posttrain starts an episode from the task's prompt, so such tasks are "
                              f"not supported")
        if isinstance(data.prompt, str):
            chat = [{"role": "user", "content": data.prompt}]
        else:
            chat = [{"role": m.role, "content": _text(m.content)} for m in data.prompt]
        if data.system_prompt:
            chat.insert(0, {"role": "system", "content": data.system_prompt})
        prompt = "\n\n".join(m["content"] for m in chat)
        wire = json.dumps(data.model_dump(mode="json", exclude_none=True))
        return Example(prompt if self.chat else f"{prompt}\n", "", wire, messages=chat if self.chat else None)

    def missing_split(self, split: str) -> str:
        return f"data=verifiers has the splits train, validation and test, not {split!r}"

    def is_correct(self, example: Example, response: str) -> bool:
        """The environment's verdict on a single response (its rubric's weighted sum against env.correct_threshold)."""
        if self.verifier is None:
            raise ConfigError("data=verifiers is judged by its environment's rubric, which the task source cannot run "
                              "itself: train with env=verifiers")
        return bool(self.verifier(example, response))

    def final_answer(self, response: str) -> str | None:
        return response.strip() or None

    def has_style(self, response: str) -> bool:
        return True


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(getattr(part, "text", "") or "" for part in content or ())


def build_verifiers_source(data_cfg) -> VerifiersSource:
    """The source of a `data=verifiers` config node (its `load` and `args` are env.load's and env.args')."""
    args = data_cfg.get("args")
    plain_args = OmegaConf.to_container(args, resolve=True) if isinstance(args, DictConfig) else dict(args or {})
    loaded = load_verifiers_environment(data_cfg.get("load"), plain_args, key="env.load")
    return VerifiersSource(loaded, data_cfg.get("limit"), data_cfg.get("heldout_size", 8), data_cfg.get("chat", True))
