"""Print the depth of the launcher's import graph and every upward import (no imports run).

    python scripts/import_graph.py [--all]

Reads every ``launcher/**/*.py`` with ``ast`` and collects its imports of other launcher
modules: module-level imports by default, every import (lazy ones inside functions too) with
``--all``.  Depth is the longest chain of imports (a module importing nothing of the launcher
has depth 1).  An *upward* import is one from a lower layer into a higher one, with the layers
(bottom to top):

  0 core      launcher.contract, launcher.topology, launcher.formats
  1 library   launcher.config, executors, export, megatron, mmlu, quant, vllm, models, tiny, rundir
  2 stages    launcher.stages, launcher.preflight
  3 entry     launcher.worker, launcher.pipeline, launcher.suite, launcher.cli

An import cycle is reported too.
"""
from __future__ import annotations

import ast
import os
import sys
from functools import lru_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = {
    0: ("launcher.contract", "launcher.topology", "launcher.formats"),
    1: ("launcher.config", "launcher.executors", "launcher.export", "launcher.megatron", "launcher.mmlu",
        "launcher.quant", "launcher.vllm", "launcher.models", "launcher.tiny", "launcher.rundir"),
    2: ("launcher.stages", "launcher.preflight"),
    3: ("launcher.worker", "launcher.pipeline", "launcher.suite", "launcher.cli"),
}


def layer(mod: str) -> int:
    for n, prefixes in LAYERS.items():
        if any(mod == p or mod.startswith(p + ".") for p in prefixes):
            return n
    return 1 if mod != "launcher" else 0


def modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "launcher")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def imports(path: str, mod: str, known: set[str], lazy: bool) -> set[str]:
    tree = ast.parse(open(path).read())
    nodes = ast.walk(tree) if lazy else tree.body
    found = set()
    pkg = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rsplit(".", 1)[0] if "." in n else ""
            if n and n != mod and n != "launcher":
                found.add(n)
    return found


def main() -> int:
    lazy = "--all" in sys.argv
    mods = modules()
    graph = {m: imports(p, m, set(mods), lazy) for m, p in mods.items()}
    stack: list[str] = []
    cycles: list[list[str]] = []

    @lru_cache(maxsize=None)
    def depth(m: str) -> int:
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return 0
        stack.append(m)
        d = 1 + max((depth(n) for n in graph[m]), default=0)
        stack.pop()
        return d

    depths = {m: depth(m) for m in sorted(graph)}
    deepest = max(depths, key=depths.get)
    chain = [deepest]
    while graph[chain[-1]]:
        chain.append(max(graph[chain[-1]], key=lambda n: depths.get(n, 0)))
        if depths[chain[-1]] <= 1 or len(chain) > 50:
            break
    upward = sorted((m, n) for m, deps in graph.items() for n in deps if layer(n) > layer(m))
    kind = "all imports (lazy included)" if lazy else "module-level imports"
    print(f"launcher import graph, {kind}: {len(graph)} modules, max depth {depths[deepest]}")
    print("  deepest chain: " + " -> ".join(chain))
    for m, n in upward:
        print(f"  upward import: {m} (layer {layer(m)}) imports {n} (layer {layer(n)})")
    for c in cycles:
        print("  cycle: " + " -> ".join(c))
    print(f"  {len(upward)} upward import(s), {len(cycles)} cycle(s)")
    return 1 if upward or cycles else 0


if __name__ == "__main__":
    sys.exit(main())
