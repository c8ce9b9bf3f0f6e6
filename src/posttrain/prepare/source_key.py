"""Which of posttrain's source files a cached SFT run (a warm start, an embedded teacher) depends
on, read from the code itself: the static import closure of the modules the run executes, so the
cache key (prepare/cache.py `code_version`) changes when one of those files does, and only then.
No list of files to keep: a new module enters the key when the SFT run's code imports it.

The closure starts at the recipe (`posttrain.train`, whose `run` trains the warm start) and the
modules of the `_target_`s the run instantiates (the SFT module), and follows every posttrain
import, those inside function bodies too, with three cuts:

1. **names, not packages**: `from posttrain.core import masked_mean` depends on core/masked.py,
   not on everything core/__init__.py re-exports. A package `__init__` made of imports only (a
   docstring, `__all__`) is a list of names: an import through it follows each name to the module
   that defines it, and the `__init__` itself is not hashed. Otherwise importing one helper of
   core/ or rewards/ would put every policy loss and reward into every warm start's key. (Python
   still executes such an `__init__`, and so imports the other modules; that only defines them.)
2. **"cache key" imports**: an import inside a function whose comment says "cache key" (the
   convention tests/test_layers.py enforces) sits in a branch an SFT run never takes (teachers,
   preference pairs, step rows, online-only checks): it is not followed.
3. **start-up checks** (`START_UP_CHECKS`): `run` checks the config (config/) and its memory
   (estimate/) before anything is built; they refuse a config or let it through, and never change
   what trains. Editing a rule must not retrain every warm start.

Everything else is followed: a module the SFT run imports is in the key even where the run never
calls it, which can only make the key change too often, never share a stale warm start."""

from __future__ import annotations

import ast
import functools
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # src/posttrain

# The layers above prepare/ that `run` calls only to check the config before it builds anything.
START_UP_CHECKS = ("posttrain.config", "posttrain.estimate")

# The word in the comment of an import inside a function that keeps it out of the closure.
NOT_IN_SFT_RUN = "cache key"


@dataclass
class Module:
    name: str                 # dotted, posttrain.x.y
    path: Path
    is_package: bool
    # name -> (module, name there) for a package __init__ made of imports only, else None
    reexports: dict[str, tuple[str, str]] | None = None
    # (dotted target, imported names or () for `import x.y`) of each import followed
    imports: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)


def module_files(root: Path) -> dict[str, Path]:
    """posttrain's modules under `root` (a copy of src/posttrain), by dotted name."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = ["posttrain", *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def statement_lists(tree: ast.Module, in_function: bool = False) -> Iterator[tuple[list[ast.stmt], bool]]:
    """Each list of statements in `tree` (a body, an `else`, a `finally`, an `except` or `case`
    body) and whether it lies inside a function. Imports are statements, so these hold all of
    them; expressions, the bulk of a tree, are never visited (a walk of every node cost about
    half a second of each run's start-up)."""
    pending = [(tree.body, in_function)]
    while pending:
        body, inside = pending.pop()
        yield body, inside
        for statement in body:
            nested = inside or isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef))
            for name in ("body", "orelse", "finalbody"):
                inner = getattr(statement, name, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    pending.append((inner, nested))
            for clause in [*getattr(statement, "handlers", []), *getattr(statement, "cases", [])]:
                pending.append((clause.body, nested))


def lazy_import_comments(tree: ast.Module, lines: list[str]) -> dict[int, str]:
    """For each import written inside a function, by line: the text of the lines from the one
    above its block of consecutive import statements to the block's last line (where its reason
    is written, as tests/test_layers.py reads it)."""
    comments = {}
    for body, inside in statement_lists(tree):
        if not inside:
            continue
        block: list[ast.stmt] = []
        for statement in [*body, None]:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                block.append(statement)
                continue
            if block:
                text = " ".join(lines[max(block[0].lineno - 2, 0): block[-1].end_lineno])
                for imp in block:
                    comments[imp.lineno] = text
            block = []
    return comments


def imported_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a `from ... import` reads, its dots resolved against `package`."""
    base = node.module or ""
    if not node.level:
        return base
    anchor = package.split(".")
    anchor = anchor[: len(anchor) - node.level + 1]
    return ".".join(anchor + ([base] if base else []))


def read_module(name: str, path: Path) -> Module:
    text = path.read_text()
    tree = ast.parse(text)
    is_package = path.name == "__init__.py"
    module = Module(name, path, is_package)
    package = name if is_package else name.rpartition(".")[0]
    lazy = lazy_import_comments(tree, text.splitlines())
    names_from: dict[str, tuple[str, str]] = {}  # what the module's top-level `from` imports name
    for node in (statement for body, _ in statement_lists(tree) for statement in body):
        if isinstance(node, ast.Import):
            targets = [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = imported_module(node, package)
            targets = [(base, tuple(alias.name for alias in node.names))]
            if node in tree.body:
                names_from.update({alias.asname or alias.name: (base, alias.name) for alias in node.names})
        else:
            continue
        if NOT_IN_SFT_RUN in lazy.get(node.lineno, ""):
            continue  # in a branch an SFT run never takes
        module.imports += [(target, names) for target, names in targets
                           if target == "posttrain" or target.startswith("posttrain.")]
    if is_package and all(is_declaration(statement) for statement in tree.body):
        module.reexports = names_from
    return module


def is_declaration(statement: ast.stmt) -> bool:
    """A statement of a package `__init__` that only names things: a docstring, an import,
    `__all__ = [...]`."""
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return True
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
        return True
    return (isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            and all(isinstance(t, ast.Name) and t.id == "__all__"
                    for t in (statement.targets if isinstance(statement, ast.Assign) else [statement.target])))


def sft_closure(entries: tuple[str, ...], root: Path = PACKAGE, cut: tuple[str, ...] = START_UP_CHECKS,
                by_name: bool = True) -> list[Path]:
    """The source files (under `root`, a copy of src/posttrain) an SFT run that executes the
    modules `entries` depends on: their import closure, cut as the module's docstring says.
    (`cut=()`, `by_name=False`: every module the run can import, whatever it runs; a test checks
    that an SFT run imports nothing outside it, so no import escapes the reading.)"""
    files = module_files(root)
    modules: dict[str, Module] = {}

    def module(name: str) -> Module:
        if name not in modules:
            modules[name] = read_module(name, files[name])
        return modules[name]

    def owner(name: str) -> str | None:
        """The module `name` (a module, or a name inside one) lives in."""
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    needed: set[str] = set()
    pending: list[str] = []

    def need(name: str) -> None:
        """`name`'s module runs: hash it and follow its imports, and those of the packages above
        it that do more than name things (their __init__ runs too)."""
        if (cut and name.startswith(cut)) or name in needed:
            return
        needed.add(name)
        pending.append(name)
        parent = name.rpartition(".")[0]
        while parent:
            if parent in files and (module(parent).reexports is None or not by_name):
                need(parent)
            parent = parent.rpartition(".")[0]

    def need_name(target: str, name: str, seen: frozenset = frozenset()) -> None:
        """`from target import name`: the module `name` is, or the one defining it."""
        if f"{target}.{name}" in files:
            need(f"{target}.{name}")
            return
        source = module(target).reexports if target in files else None
        if by_name and source is not None and name in source and (target, name) not in seen:
            inner_target, inner_name = source[name]
            inner = owner(inner_target)
            if inner is not None:
                need_name(inner, inner_name, seen | {(target, name)})
                return
        if target in files:
            need(target)

    for entry in entries:
        need(entry)
    while pending:
        for target, names in module(pending.pop()).imports:
            resolved = owner(target)
            if resolved is None:
                continue
            if names and resolved == target:
                for name in names:
                    need_name(resolved, name)
            else:
                need(resolved)
    return sorted(files[name] for name in needed if module(name).reexports is None or not by_name or name in entries)


@functools.cache
def source_digest(entries: tuple[str, ...], root: Path = PACKAGE) -> str:
    """A hash of the contents (and paths) of the files of `sft_closure(entries, root)`."""
    digest = hashlib.sha256()
    for path in sft_closure(entries, root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
