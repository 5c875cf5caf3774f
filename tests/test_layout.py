"""The package layout: each layer (a subpackage) imports only the layers below it, imports
inside knorm_gen point one way (no cycle), and no module outside config.py restates a
default the configs own."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "knorm_gen"

LAYERS = ("platform", "eviction", "models", "generation", ("batch", "tuning"), "cli")
"""Bottom to top; a tuple is one floor whose members do not import each other."""


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def internal_imports() -> dict[str, set[str]]:
    """module (dotted, e.g. knorm_gen.eviction.cache) -> the knorm_gen modules it imports
    (at any depth of its code, lazy imports included)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                if node.module:
                    deps.add(".".join(base + node.module.split(".")))
                else:
                    deps.update(".".join(base + [a.name]) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("knorm_gen."):
                deps.add(node.module)
        graph[name] = {d for d in deps if d != name}
    return graph


def layer_of(module: str):
    """The floor (index into LAYERS) of a module, or None for the package's own __init__."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1].startswith("__"):  # the package itself (its __version__)
        return None
    for i, floor in enumerate(LAYERS):
        if parts[1] in (floor if isinstance(floor, tuple) else (floor,)):
            return i
    raise AssertionError(f"{module} belongs to no layer of {LAYERS}")


def find_cycle(graph: dict[str, set[str]]):
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_inside_the_package():
    graph = internal_imports()
    assert {"knorm_gen.eviction.config", "knorm_gen.eviction.cache", "knorm_gen.generation.engine",
            "knorm_gen.batch.runner", "knorm_gen.batch.job", "knorm_gen.cli.batch"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_each_layer_imports_only_the_layers_below_it():
    # The eviction core knows nothing of generation, the batch job or the command line; the
    # product (generation, the batch job) does not import the tuner; the tuner not the job.
    up = []
    for module, deps in internal_imports().items():
        here = layer_of(module)
        if here is None:
            continue
        for dep in deps:
            there = layer_of(dep)
            if there is not None and (there > here or (there == here and dep.split(".")[1] != module.split(".")[1])):
                up.append(f"{module} imports {dep}")
    assert not up, "; ".join(sorted(up))


def test_the_layer_check_finds_an_import_that_runs_up():
    assert layer_of("knorm_gen.eviction.cache") < layer_of("knorm_gen.generation.engine")
    assert layer_of("knorm_gen.batch.job") == layer_of("knorm_gen.tuning.tune")


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_defaults_are_stated_once():
    # The configs own these defaults; any other module must read them from there.
    from knorm_gen.eviction.config import EvictionConfig, GenerationConfig

    owned = {"budget": EvictionConfig.budget, "max_tokens": GenerationConfig.max_tokens,
             "prefill_step_size": GenerationConfig.prefill_step_size}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "config.py":
            continue
        text = path.read_text()
        for name, value in owned.items():
            pattern = rf"\b{name}\s*(?::\s*\w+\s*)?=\s*{value}\b|--{name.replace('_', '-')}\",[^)]*default={value}\b"
            assert not re.search(pattern, text), f"{path.name} restates the default {name}={value}"
