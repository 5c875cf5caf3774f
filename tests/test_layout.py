"""The package layout: imports inside knorm_gen point one way (no cycle), and no
module outside config.py restates a default the configs own."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "knorm_gen"


def internal_imports() -> dict[str, set[str]]:
    """module -> the knorm_gen modules it imports (at any depth of its code)."""
    graph = {}
    for path in PACKAGE.glob("*.py"):
        name = path.stem
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("knorm_gen."):
                deps.add(node.module.split(".")[1])
        graph[name] = deps - {name}
    return graph


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
    assert {"config", "cache", "engine", "runner", "job", "cli"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_defaults_are_stated_once():
    # The configs own these defaults; any other module must read them from there.
    from knorm_gen.config import EvictionConfig, GenerationConfig

    owned = {"budget": EvictionConfig.budget, "max_tokens": GenerationConfig.max_tokens,
             "prefill_step_size": GenerationConfig.prefill_step_size}
    for path in PACKAGE.glob("*.py"):
        if path.name == "config.py":
            continue
        text = path.read_text()
        for name, value in owned.items():
            pattern = rf"\b{name}\s*(?::\s*\w+\s*)?=\s*{value}\b|--{name.replace('_', '-')}\",[^)]*default={value}\b"
            assert not re.search(pattern, text), f"{path.name} restates the default {name}={value}"
