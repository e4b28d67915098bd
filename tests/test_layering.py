"""The launcher's imports go one way: down the layers, and never around a cycle of packages.

Read with ``ast`` only (nothing is imported): every ``import`` of a launcher module counts,
module-level ones, lazy ones inside functions, those under ``if TYPE_CHECKING:``, and
``importlib.import_module("...")`` / ``__import__("...")`` of a literal name.  A *unit*
is a top-level module (``launcher.paths``) or a top-level package (``launcher.mmlu``, with all its
modules).  Layers, bottom to top (``LAYERS``):

  vocabulary  pure modules every layer may name: the contract, the topology, formats, paths,
              the schema and its rules, the config.json reader, what a rank reads from Slurm's
              environment (slurm_env: the sbatch renderer, the worker and megatron.dist share it)
  libraries   the torch side, the gate's libraries, executors, export, vLLM, the report, the stage profiler, run
              directories
  stages      the stage implementations and the pre-start checks
  services    config composition and validation, the worker, the pipeline, the suite, the CLI

The rules: no import goes to a higher layer; no two units import each other, directly or
through others (the unit graph has no strongly connected component of two or more units); every
unit has a layer (a new top-level module or package must be placed in ``LAYERS``); and the product
never imports the test fixtures (``FIXTURES``: ``launcher_testing``, the tiny model builds, the
SmolLM2 build, the rank helpers), which sit above all of it: tests and benchmarks import both.
"""
from __future__ import annotations

import ast
import os
from typing import Iterable, Mapping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vocabulary", ("contract", "topology", "formats", "architectures", "paths", "schema", "schema_rules", "hf_config",
                    "slurm_env", "ports")),
    ("libraries", ("executors", "export", "megatron", "mmlu", "quant", "vllm", "report", "rundir", "hold",
                   "profiling")),
    ("stages", ("stages", "preflight")),
    ("services", ("config", "worker", "pipeline", "suite", "cli")),
)
FIXTURES: tuple[str, ...] = ("launcher_testing",)   # top-level packages the product never imports


def sources(root: str, package: str = "launcher") -> dict[str, str]:
    """{module name: source text} of every .py file under root/package."""
    out = {}
    for dirpath, _, files in os.walk(os.path.join(root, package)):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                name = name[: -len(".__init__")] if name.endswith(".__init__") else name
                with open(path, encoding="utf-8") as fh:
                    out[name] = (fh.read(), f == "__init__.py")
    return out


def imports(module: str, source: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement anywhere in ``source`` (relative imports
    resolved; ``from X import name`` counts as X.name, a module or not)."""
    base_pkg = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = base_pkg.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            out.append((node.lineno, node.args[0].value))
    return out


def unit_of(module: str, package: str = "launcher") -> str | None:
    """'launcher.mmlu.gate' -> 'mmlu'; None for the package itself or a module outside it."""
    parts = module.split(".")
    if parts[0] != package or len(parts) < 2:
        return None
    return parts[1]


def layer_of(unit: str, layers=LAYERS) -> int | None:
    return next((i for i, (_, units) in enumerate(layers) if unit in units), None)


def unit_edges(mods: Mapping[str, tuple[str, bool]], package: str = "launcher"
               ) -> list[tuple[str, int, str, str, str]]:
    """(module, line, target, from unit, to unit) for every import of another unit."""
    out = []
    for module, (source, is_package) in sorted(mods.items()):
        src = unit_of(module, package)
        for line, target in imports(module, source, is_package):
            dst = unit_of(target, package)
            if src and dst and dst != src:
                out.append((module, line, target, src, dst))
    return out


def components(nodes: Iterable[str], edges: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more nodes (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def violations(mods: Mapping[str, tuple[str, bool]], layers=LAYERS, package: str = "launcher",
               fixtures: tuple[str, ...] = FIXTURES) -> list[str]:
    """Every broken rule, one line each, naming the module, the line and the target."""
    out = []
    for module, (source, is_package) in sorted(mods.items()):
        for line, target in imports(module, source, is_package):
            if target.split(".")[0] in fixtures:
                out.append(f"fixture import: {module}:{line} imports {target} "
                           f"(the product never imports {target.split('.')[0]})")
    units = sorted({u for m in mods if (u := unit_of(m, package))})
    for u in units:
        if layer_of(u, layers) is None:
            out.append(f"{package}.{u} has no layer: place it in LAYERS ({', '.join(n for n, _ in layers)})")
    edges = unit_edges(mods, package)
    for module, line, target, src, dst in edges:
        ls, ld = layer_of(src, layers), layer_of(dst, layers)
        if ls is not None and ld is not None and ld > ls:
            out.append(f"upward import: {module}:{line} imports {target} "
                       f"({layers[ls][0]} -> {layers[ld][0]})")
    graph: dict[str, set[str]] = {}
    for *_, src, dst in edges:
        graph.setdefault(src, set()).add(dst)
    for comp in components(units, graph):
        inside = [f"{m}:{line} -> {t}" for m, line, t, s, d in edges if s in comp and d in comp]
        out.append(f"import cycle between {', '.join(package + '.' + u for u in comp)}: " + "; ".join(inside))
    return out


def test_launcher_imports_go_down_the_layers():
    problems = violations(sources(ROOT))
    assert not problems, "launcher's layering is broken:\n  " + "\n  ".join(problems)


def test_the_checker_reports_an_upward_import_and_a_cycle():
    mods = {
        "launcher.paths": ("import os\n", False),
        "launcher.mmlu": ("", True),
        "launcher.mmlu.gate": ("def f():\n    from launcher.config.validate import validate\n", False),
        "launcher.quant": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from launcher.mmlu import gate\n",
                           True),
        "launcher.executors": ("from ..quant import x\n", True),
        "launcher.mmlu.data": ("import launcher.executors\n", False),
        "launcher.config": ("from launcher.paths import cache_dir\n", True),
        "launcher.config.validate": ("", False),
        "launcher.newthing": ("", False),
    }
    problems = violations(mods)
    assert "upward import: launcher.mmlu.gate:2 imports launcher.config.validate.validate " \
           "(libraries -> services)" in problems
    assert any(p.startswith("import cycle between launcher.executors, launcher.mmlu, launcher.quant: ")
               and "launcher.quant:3 -> launcher.mmlu.gate" in p and "launcher.executors:1 -> launcher.quant.x" in p
               for p in problems), problems
    assert "launcher.newthing has no layer: place it in LAYERS (vocabulary, libraries, stages, services)" in problems
    assert len(problems) == 3, problems
    assert not violations({"launcher.paths": ("import os\n", False),
                           "launcher.config": ("from launcher.paths import cache_dir\n", True)})


def test_the_checker_reports_a_fixture_import():
    mods = {
        "launcher.paths": ("def f():\n    from launcher_testing.tiny import ensure_tiny_model\n", False),
        "launcher.mmlu": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import launcher_testing.ranks\n",
                          True),
        "launcher.cli": ("import importlib\nimportlib.import_module('launcher_testing.models')\n", False),
        "launcher.config": ("import launcher_testing_other\nfrom launcher.paths import cache_dir\n", True),
    }
    why = "(the product never imports launcher_testing)"
    assert violations(mods) == [
        f"fixture import: launcher.cli:2 imports launcher_testing.models {why}",
        f"fixture import: launcher.mmlu:3 imports launcher_testing.ranks {why}",
        f"fixture import: launcher.paths:2 imports launcher_testing.tiny.ensure_tiny_model {why}",
    ]


if __name__ == "__main__":   # print the current problems (what the first test asserts is empty)
    for p in violations(sources(ROOT)):
        print(p)
