"""The import rules of CONTRIBUTING.md, read from the source's import lines (every ``import`` and
``from ... import``, module level or inside a function): no cycle among the project's modules, and
the floors import only downwards (cluster/ nothing from launch/, learner/ nothing from actors/;
correction/ and buffer/ stay free of ray, deepspeed and vllm). What is not fixed yet is listed, with
why, in KNOWN_CYCLES / KNOWN_UPWARD; an entry that no longer holds fails too, so the lists shrink."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx   # torch's own dependency, pinned in requirements.lock

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("actors", "buffer", "cluster", "common", "correction", "learner", "launch", "schedule",
            "tasks", "bench")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for d in PACKAGES for p in sorted((REPO / d).rglob("*.py"))}


MODULES = _sources()


def _imported(name: str, path: Path) -> set[str]:
    """Every module name ``name`` (at ``path``) imports, relative imports resolved; ``from a.b
    import c`` names a.b.c when that is a module, else a.b."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        graph[name] = {m for m in _imported(name, path) if m in MODULES and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, each sorted."""
    g = nx.DiGraph()
    g.add_nodes_from(graph)
    g.add_edges_from((a, b) for a, targets in graph.items() for b in targets)
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def test_the_graph_holds_every_project_module():
    graph = _graph()
    assert len(graph) > 50 and "actors.engine" in graph and "tests" not in {m.split(".")[0]
                                                                         for m in graph}
    assert "actors.native.engine" in graph["actors.native"]   # a package's __init__ counts


# Cycles not broken yet, each with why; the test fails once one is gone (delete its entry).
KNOWN_CYCLES: dict = {
}


def test_no_import_cycle():
    graph = _graph()
    cycles = _cycles(graph)
    new = [c for c in cycles if frozenset(c) not in KNOWN_CYCLES]
    lines = []
    for component in new:
        members = set(component)
        edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
        lines.append(" <-> ".join(component) + "\n    " + "\n    ".join(edges))
    assert not new, "import cycles:\n" + "\n".join(lines)
    gone = set(KNOWN_CYCLES) - {frozenset(c) for c in cycles}
    assert not gone, f"no longer cycles, delete from KNOWN_CYCLES: {sorted(map(sorted, gone))}"


# The floors (CONTRIBUTING.md): a package imports its own floor and the floors below, never above.
FLOORS = {"common": 0, "correction": 1, "buffer": 1, "tasks": 1,
          "actors": 2, "learner": 2, "schedule": 2, "cluster": 2, "launch": 3, "bench": 4}
# Same floor, one direction only: the trainer never reaches into an engine.
BANNED = {"learner": ("actors",)}
# Third-party packages a floor must not import: the pure math and the buffer run anywhere.
THIRD_PARTY_BANNED = {"correction": ("ray", "deepspeed", "vllm"),
                      "buffer": ("ray", "deepspeed", "vllm")}
# Upward reads not removed yet, each with why; the test fails once one is gone (delete it).
KNOWN_UPWARD: dict = {
}


def _breaks_floors(name: str, target: str) -> bool:
    floor, top = name.split(".")[0], target.split(".")[0]
    if top in FLOORS:
        return FLOORS[top] > FLOORS[floor] or top in BANNED.get(floor, ())
    return top in THIRD_PARTY_BANNED.get(floor, ())


def _violations() -> list[tuple[str, str]]:
    return [(name, target) for name, path in MODULES.items()
            for target in sorted(_imported(name, path)) if _breaks_floors(name, target)]


def test_floors_import_only_downwards():
    assert set(FLOORS) == set(PACKAGES)
    found = _violations()
    new = [f"{MODULES[a].relative_to(REPO)} imports {b}" for a, b in found
           if (a, b) not in KNOWN_UPWARD]
    assert not new, "layering broken:\n" + "\n".join(new)
    gone = set(KNOWN_UPWARD) - set(found)
    assert not gone, f"fixed, delete from KNOWN_UPWARD: {sorted(gone)}"


def test_the_checks_catch_a_cycle_and_an_upward_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert _breaks_floors("learner.distill", "actors.config")
    assert _breaks_floors("cluster.kuberay.render", "launch.config")
    assert _breaks_floors("correction.loss", "ray")
    assert not _breaks_floors("learner.distill", "common.kept")
    assert not _breaks_floors("launch.train", "actors.config")


def test_imports_inside_functions_and_relative_ones_are_read(tmp_path):
    mod = tmp_path / "x.py"
    mod.write_text("def f():\n    from actors.native import policies, NativeEngine\n"
                   "    import buffer.schema\n")
    assert _imported("actors.vllm.evict.x", mod) == {"actors.native.policies", "actors.native",
                                                       "buffer.schema"}
    pkg = tmp_path / "__init__.py"
    pkg.write_text("from .engine import VLLMEngine\nfrom . import kv\nfrom ..config import KVConfig\n")
    assert _imported("actors.vllm", pkg) == {"actors.vllm.engine", "actors.vllm.kv", "actors.config"}
