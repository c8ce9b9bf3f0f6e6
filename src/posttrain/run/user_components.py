"""A researcher's own components, named in the config by `_target_: package.module.Name`: one
convention for Lightning callbacks (`callbacks.extra`), Lightning loggers (`logger.extra`) and
reward functions (`reward.components.<name>._target_`), each checked at start-up (importable,
the right kind, its options those its signature takes) before any weights load.

The module is found as any import is, on `sys.path`, with the directory the command was
launched from added to its end: a console script (`posttrain`) puts its own bin/ directory on
the path, not the working directory, so without it a file beside the user's config would not
be found. The launch directory is Hydra's `runtime.cwd`, the same for every job of a sweep
and kept when `hydra.job.chdir=true` moves a job into its run dir. `PYTHONPATH` works too.

It lives in run/, the lowest layer that builds a run's Lightning objects: run/callbacks.py and
run/tracking.py beside it build the callbacks and loggers with it, rewards/build.py above it
imports and checks the reward functions with it (and so the config check's dry run does).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from posttrain.errors import ConfigError, PosttrainError

TARGET = "_target_"


def launch_dir() -> Path:
    """The directory the command was started in: Hydra's runtime.cwd inside a job, else the cwd."""
    # start-up: Hydra's internals load only inside a job
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.cwd)
    return Path(os.getcwd())


def make_launch_dir_importable() -> Path:
    """Put the launch directory at the end of sys.path (after the installed packages, so that a
    file of the user's never hides one of them), once."""
    directory = launch_dir()
    if str(directory) not in sys.path:
        sys.path.append(str(directory))
    return directory


def import_target(key: str, path: Any) -> Any:
    """The object at the dotted path `path` (`key._target_`), or a ConfigError naming the key,
    the path, what went wrong and where modules are looked for."""
    if not isinstance(path, str) or "." not in path.strip("."):
        raise ConfigError(f"{key}.{TARGET} must be a dotted path like 'package.module.Name', got {path!r}")
    directory = make_launch_dir_importable()
    module_path, _, attribute = path.rpartition(".")
    try:
        module = importlib.import_module(module_path)
    except Exception as err:  # a missing module, or the module failing on import
        raise ConfigError(f"{key}.{TARGET}={path!r} cannot be imported: {type(err).__name__}: {err} (modules are "
                          f"found on sys.path: the launch directory {directory}, PYTHONPATH and the installed "
                          f"packages)") from err
    if not hasattr(module, attribute):
        raise ConfigError(f"{key}.{TARGET}={path!r} cannot be imported: module {module_path!r} (from "
                          f"{getattr(module, '__file__', None) or 'no file'}) has no {attribute!r}")
    return getattr(module, attribute)


def import_class(key: str, path: Any, base: type, base_name: str) -> type:
    """The class at `path`, which must subclass `base` (public name `base_name`)."""
    found = import_target(key, path)
    if not (isinstance(found, type) and issubclass(found, base)):
        kind = f"the class {found.__name__}" if isinstance(found, type) else f"a {type(found).__name__}"
        raise ConfigError(f"{key}.{TARGET}={path!r} is {kind}, not a subclass of {base_name}")
    return found


def import_function(key: str, path: Any) -> Callable[..., Any]:
    """The callable at `path` (a function, or any object one can call)."""
    found = import_target(key, path)
    if not callable(found) or isinstance(found, type):
        raise ConfigError(f"{key}.{TARGET}={path!r} is a {type(found).__name__}, not a function")
    return found


def check_options(key: str, target: Callable[..., Any], options: Iterable[str], *, named: str,
                  supplied: tuple[str, ...] = (), hidden: tuple[str, ...] = (),
                  config_keys: tuple[str, ...] = ()) -> None:
    """Refuse options `target` does not take, and required ones left out, before the run starts.

    The leading positional parameters `supplied` (`samples, source` of a reward function) and
    the `hidden` ones are filled in by the code, not the config; `config_keys` are keys of the
    entry that are not arguments (`_target_`, `weight`). `named`: how messages name the target."""
    options = set(options) - set(config_keys)
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return  # a callable without an inspectable signature: it will complain when called
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < len(supplied) and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise ConfigError(f"{key}: {named} must take ({', '.join(supplied)}) as its first arguments")
    taken = [p for p in params[len(supplied):] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             and p.name not in hidden]
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        unknown = sorted(options - {p.name for p in taken})
        if unknown:
            valid = [*config_keys, *(p.name for p in taken)]
            raise ConfigError(f"unknown option(s) {', '.join(f'{key}.{name}' for name in unknown)}: {named} takes "
                              f"no such argument; valid options: {', '.join(valid)}")
    missing = [p.name for p in taken if p.default is p.empty and p.name not in options]
    if missing:
        raise ConfigError(f"{key}: missing required option(s) {missing} that {named} needs")


# --- lists of Lightning objects: callbacks.extra, logger.extra ------------------------------------

def component_bases() -> dict[str, tuple[type, str]]:
    """Each config list of user objects: the class its entries must subclass, and its public name."""
    # start-up: Lightning loads only once the command line is parsed
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import Logger

    return {"callbacks.extra": (Callback, "lightning.pytorch.callbacks.Callback"),
            "logger.extra": (Logger, "lightning.pytorch.loggers.Logger")}


def component_entries(cfg: DictConfig, key: str) -> list[tuple[str, dict[str, Any]]]:
    """(`key[i]`, the entry as plain Python) for each entry of the list at `key` (none if absent)."""
    entries = OmegaConf.select(cfg, key)
    if entries is None:
        return []
    if not isinstance(entries, ListConfig):
        raise ConfigError(f"{key} must be a list of {{{TARGET}: package.module.Class, <options>}}, got {entries!r}")
    listed = []
    for index, entry in enumerate(entries):
        where = f"{key}[{index}]"
        if not isinstance(entry, DictConfig) or TARGET not in entry:
            raise ConfigError(f"{where} must be a mapping {{{TARGET}: package.module.Class, <options>}}, got {entry!r}")
        listed.append((where, OmegaConf.to_container(entry, resolve=True)))
    return listed


def check_component(where: str, entry: dict[str, Any], base: tuple[type, str]) -> type:
    """The class an entry names, checked: a subclass of `base` that takes the entry's options."""
    component = import_class(where, entry[TARGET], *base)
    check_options(where, component, entry, named=entry[TARGET], config_keys=(TARGET,))
    return component


def check_user_components(cfg: DictConfig) -> None:
    """The start-up check of every user callback and logger (nothing is built)."""
    for key, base in component_bases().items():
        for where, entry in component_entries(cfg, key):
            check_component(where, entry, base)


def build_user_components(cfg: DictConfig, key: str) -> list:
    """The objects the list at `key` names, built in order (Hydra's `instantiate`: nested
    `_target_` options are built too; options arrive as plain dicts and lists)."""
    # start-up: Hydra's instantiate loads only when a run builds its components
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    built = []
    for where, entry in component_entries(cfg, key):
        check_component(where, entry, component_bases()[key])
        try:
            built.append(instantiate(entry, _convert_="all"))
        except InstantiationException as err:
            # Hydra wraps what the class raised; a config mistake must reach the user as itself
            if isinstance(err.__cause__, PosttrainError):
                raise err.__cause__ from None
            raise
    return built
