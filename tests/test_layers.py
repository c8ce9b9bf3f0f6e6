"""The architecture, kept: every package under src/posttrain is one layer, and a module imports
only from the layers below its own (never from a room beside it, never from above). Every
import counts, those written inside functions too. `python -m pytest tests/test_layers.py -s`
prints the layer table and the figures a reader of the architecture wants.

LAYERS is the one place the order is written. A room is a package (`models/`) or a loose
module at the top of the package (`errors.py`); within a room modules import each other
freely, as long as they make no circle."""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.prepare.source_key import imported_module

SOURCE = Path(__file__).resolve().parents[1] / "src" / "posttrain"

# Bottom up. A room imports rooms of lower layers only.
LAYERS = (
    ("core", "errors", "files", "conf"),      # pure math; user-facing errors; atomic writes; the Hydra YAML
    ("distributed",),                         # collectives, per-rank state, FSDP2 sharding
    ("models",),                              # networks and weights, the training forward
    ("rollout", "data", "run"),               # sampling engines; tasks and batches; a run's plumbing
    ("envs",),                                # environments: episodes, tools, the code sandbox
    ("rewards",),                             # a rollout batch -> reward samples
    ("algorithms", "prepare"),                # the LightningModules; what is made once before training
    ("config", "eval"),                       # what conf/ accepts; posttrain-eval, best-of-N, report
    ("estimate",),                            # the memory check, posttrain-estimate: composes and checks a config
    ("train",),                               # the recipe: nothing imports it
)
LOOSE_MODULES = ("train", "errors", "files")  # the only modules allowed at src/posttrain/
# An import inside a function body must say why it is not at the top: one of these words in a
# comment on the line above its block of imports, or on the line of one of them. "cache key":
# the import sits in a branch an SFT run never takes, and the warm start's cache key
# (prepare/source_key.py) does not follow it.
LAZY_REASONS = ("start-up", "optional", "cache key")


@dataclass
class Import:
    source: str          # the importing module, dotted
    target: str          # the imported posttrain module, dotted
    line: int
    in_function: bool


@dataclass
class Graph:
    modules: dict[str, Path] = field(default_factory=dict)
    imports: list[Import] = field(default_factory=list)
    unmarked_lazy: list[str] = field(default_factory=list)  # "module:line  import ..." without a reason


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The posttrain module that `name` (a module, or a name inside one) lives in."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def lazy_import_blocks(tree: ast.AST) -> dict[int, tuple[int, int]]:
    """Imports written inside a function: line -> (first, last line) of the run of import
    statements it stands in (a block of lazy imports shares one comment)."""
    blocks = {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for body in (getattr(inner, name) for inner in ast.walk(node) for name in ("body", "orelse", "finalbody")
                     if isinstance(getattr(inner, name, None), list)):
            run: list[ast.stmt] = []
            for statement in [*body, None]:
                if isinstance(statement, (ast.Import, ast.ImportFrom)):
                    run.append(statement)
                    continue
                for imp in run:
                    blocks[imp.lineno] = (run[0].lineno, run[-1].end_lineno)
                run = []
    return blocks


def read_graph(root: Path = SOURCE) -> Graph:
    graph = Graph()
    for path in sorted(root.rglob("*.py")):
        graph.modules[module_name(path, root)] = path
    for name, path in graph.modules.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        lazy = lazy_import_blocks(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = imported_module(node, package)
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            if node.lineno in lazy:
                first, last = lazy[node.lineno]
                comment = " ".join(lines[max(first - 2, 0): last])
                if not any(reason in comment for reason in LAZY_REASONS):
                    graph.unmarked_lazy.append(f"{name}:{node.lineno}  {lines[node.lineno - 1].strip()}")
            for target in targets:
                if not target.startswith("posttrain"):
                    continue
                resolved = resolve(target, graph.modules)
                if resolved is not None and resolved != name:
                    graph.imports.append(Import(name, resolved, node.lineno, node.lineno in lazy))
    return graph


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "posttrain"


def layer_of(room_name: str) -> int | None:
    for index, rooms in enumerate(LAYERS):
        if room_name in rooms:
            return index
    return None


def circles(graph: Graph) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan)."""
    edges = defaultdict(set)
    for imp in graph.imports:
        edges[imp.source].add(imp.target)
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def wrong_way(graph: Graph) -> list[str]:
    """Imports into a room of the same or a higher layer, and imports of train.py."""
    bad = []
    for imp in graph.imports:
        source_room, target_room = room(imp.source), room(imp.target)
        if source_room == target_room:
            continue
        source_layer, target_layer = layer_of(source_room), layer_of(target_room)
        if target_room == "train" or source_layer is None or target_layer is None or target_layer >= source_layer:
            bad.append(f"{imp.source}:{imp.line} imports {imp.target} ({source_room} -> {target_room})")
    return bad


def figures(graph: Graph) -> dict[str, object]:
    arrows = {(room(i.source), room(i.target)) for i in graph.imports if room(i.source) != room(i.target)}
    sizes = {name: len(path.read_text().splitlines()) for name, path in graph.modules.items()}
    largest = max(sizes, key=sizes.get)
    loose = [name for name, path in graph.modules.items() if path.parent == SOURCE and name != "posttrain"]
    return {
        "modules": len(graph.modules),
        "import ties": len({(i.source, i.target) for i in graph.imports}),
        "ties only inside functions": len({(i.source, i.target) for i in graph.imports if i.in_function}
                                          - {(i.source, i.target) for i in graph.imports if not i.in_function}),
        "arrows between rooms": len(arrows),
        "circles": len(circles(graph)),
        "wrong-way imports": len(wrong_way(graph)),
        "loose modules": len(loose),
        "largest file": f"{graph.modules[largest].relative_to(SOURCE)} ({sizes[largest]} lines)",
    }


def layer_table(graph: Graph) -> str:
    lines_by_room = defaultdict(int)
    for name, path in graph.modules.items():
        lines_by_room[room(name)] += len(path.read_text().splitlines())
    rows = ["layer  room          lines  imports from"]
    for index, rooms in reversed(list(enumerate(LAYERS))):
        for name in rooms:
            below = sorted({room(i.target) for i in graph.imports if room(i.source) == name} - {name})
            rows.append(f"{index:>5}  {name:<12}{lines_by_room.get(name, 0):>6}  {', '.join(below) or '-'}")
    return "\n".join(rows)


@functools.cache
def source_graph() -> Graph:
    """src/posttrain's graph, read once when a test asks (not at collection, on every worker)."""
    return read_graph()


def test_print_the_architecture():
    print("\n" + layer_table(source_graph()))
    for key, value in figures(source_graph()).items():
        print(f"{key}: {value}")
    rooms = {room(name) for name in source_graph().modules} - {"posttrain"}
    assert rooms <= {name for layer in LAYERS for name in layer}, "a room no layer names"


def test_no_import_circles():
    assert circles(source_graph()) == []


def test_every_import_points_down():
    assert wrong_way(source_graph()) == []


def test_at_most_three_loose_modules():
    loose = sorted(p.stem for p in SOURCE.glob("*.py") if p.name != "__init__.py")
    assert set(loose) <= set(LOOSE_MODULES), loose


def test_imports_inside_functions_say_why():
    assert source_graph().unmarked_lazy == []


def test_the_checker_sees_what_it_must(tmp_path):
    """The reader itself: a circle through a function-body import, a relative import, an
    import of train.py and an upward import are all found in a made-up tree."""
    root = tmp_path / "posttrain"
    for package in ("core", "models"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "train.py").write_text("from posttrain.models.net import Net\n")
    (root / "core" / "math.py").write_text("def f():\n    from posttrain.models import net  # start-up\n")
    (root / "models" / "net.py").write_text("from ..core.math import f\nimport posttrain.train\nclass Net: ...\n")
    graph = read_graph(root)
    assert circles(graph) == [["posttrain.core.math", "posttrain.models.net", "posttrain.train"]]
    assert {(i.source, i.target, i.in_function) for i in graph.imports} == {
        ("posttrain.train", "posttrain.models.net", False),
        ("posttrain.core.math", "posttrain.models.net", True),
        ("posttrain.models.net", "posttrain.core.math", False),
        ("posttrain.models.net", "posttrain.train", False),
    }
    assert len(wrong_way(graph)) == 2  # core -> models (upward), models -> train
    assert graph.unmarked_lazy == []
    (root / "core" / "math.py").write_text("def f():\n    import json\n    from posttrain.models import net\n")
    assert [line.split()[0] for line in read_graph(root).unmarked_lazy] == ["posttrain.core.math:2", "posttrain.core.math:3"]
