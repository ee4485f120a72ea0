"""The package's layers: a module imports only from its own package and the layers below it,
at module level and inside functions alike (README, "How it works").  Read from the source,
so an import that would only run on some path is caught too."""
from __future__ import annotations

import ast
import pathlib

import autopar

ROOT = pathlib.Path(autopar.__file__).parent

# bottom to top; a package imports only from packages on lower floors
LAYERS = [
    ("placement",),
    ("comm",),
    ("launch",),  # the launcher: torch elastic, and comm's exit handling in each rank
    ("mesh",),
    ("spec",),
    ("redistribute",),
    ("spmd",),  # rules and their kernels (a kernel redistributes)
    ("tensor",),  # DistTensor, op dispatch, differentiable conversions, the shared random stream
    ("runtime", "checkpoint"),  # local regions, gradient reduction, ZeRO; sharded checkpoints
    ("api",),  # the public functions: shard_tensor, shard_layer, shard_optimizer, parallelize...
    ("pipelining",),
    ("static",),
    ("tools",),  # simulate, explain
    ("planner",),
    ("auto_parallel", "plan"),  # Paddle's dist.auto_parallel spelling; the old planner command
    ("autopar",),  # the public names
]
FLOOR = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _unit(module: str) -> str:
    """The package (or top-level module) a module of autopar belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "autopar"


def _module_of(path: pathlib.Path) -> str:
    parts = ("autopar",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path):
    """(line, imported module) of every import of autopar in the file, relative ones resolved."""
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from autopar import comm` imports the package comm
            names = [f"{target}.{a.name}" if target == "autopar" else target for a in node.names]
        else:
            continue
        for name in names:
            if name == "autopar" or name.startswith("autopar."):
                yield node.lineno, name


def _edges() -> list[tuple[str, str, str]]:
    """(importing unit, imported unit, where) for every import between two units."""
    edges = []
    for path in sorted(ROOT.rglob("*.py")):
        unit = _unit(_module_of(path))
        for line, name in _imports(path):
            target = _unit(name) if name != "autopar" else "autopar"
            if target != unit:
                edges.append((unit, target, f"{path.relative_to(ROOT.parent)}:{line} imports {name}"))
    return edges


def test_every_package_has_a_floor():
    units = {_unit(_module_of(p)) for p in ROOT.rglob("*.py")}
    assert units <= set(FLOOR), f"packages without a layer: {sorted(units - set(FLOOR))}"


def test_no_import_reaches_up_or_sideways():
    bad = [where for unit, target, where in _edges() if FLOOR[target] >= FLOOR[unit]]
    assert not bad, "imports into a layer that is not below:\n" + "\n".join(bad)


def test_no_import_cycle_between_packages():
    graph: dict = {}
    for unit, target, _ in _edges():
        graph.setdefault(unit, set()).add(target)

    def reaches(a, b, seen=()):
        return any(n == b or (n not in seen and reaches(n, b, seen + (n,))) for n in graph.get(a, ()))

    cycles = sorted(u for u in graph if reaches(u, u))
    assert not cycles, f"packages on an import cycle: {cycles}"
