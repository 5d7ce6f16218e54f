"""The package import graph of rung, read from the source with `ast` (nothing is imported).

    python -m rung.bench.import_graph [ROOT]      # ROOT: a checkout, this one by default

Prints one line per package: the rung packages it imports and how many import statements
do so, then whether the graph keeps to the layering and has no cycle. Every import counts,
including those under ``if TYPE_CHECKING:`` and inside functions: a type-only import of a
higher layer is still a dependency a reader has to hold in mind.

The layering (each package may import only the packages listed for it):

    core     -> (nothing)            descriptor, graph modes, KV cache spec, metadata, context
    kernels  -> core                 attention backends and kernels
    models   -> kernels, core        model definitions and weight loading
    graphs   -> kernels, core        ladder, dispatcher, capture, compiler, graph manager
    runtime  -> graphs, models, kernels, core
    bench    -> runtime and below    tools and benchmarks, never imported by the library
    server   -> runtime (public API) `rung serve`: imports only the module ``rung.runtime``
                                     (LLMEngine's step API, SamplingParams, outputs), so it
                                     stays a tool on top of the engine, never a second one
    cli      -> anything             runtime/cli.py, the `rung` console entry point: the one
                                     module above bench and server (`rung bench` runs
                                     bench/latency.py, `rung serve` server/app.py)

models and graphs are siblings: a model never knows whether it is captured, and the graph
machinery sees a model only as an ``nn.Module``.
"""

from __future__ import annotations

import ast
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "kernels", "models", "graphs", "runtime", "bench", "server")
NODES = PACKAGES + ("cli",)
ENTRY_POINTS = {"runtime/cli.py": "cli"}      # modules that are a node of their own
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "kernels": {"core"},
    "models": {"kernels", "core"},
    "graphs": {"kernels", "core"},
    "runtime": {"graphs", "models", "kernels", "core"},
    "bench": {"runtime", "graphs", "models", "kernels", "core"},
    "server": {"runtime"},
    "cli": {"server", "bench", "runtime", "graphs", "models", "kernels", "core"},
}
# packages that may import only these modules of what ALLOWED lets them import
PUBLIC_ONLY: dict[str, set[str]] = {"server": {"rung.runtime"}}

Edge = tuple[str, str, str]          # (importing node, imported node, "file imports module")


def _node(path: str) -> str:
    return ENTRY_POINTS.get(path, path.split("/")[0])


def _imported_modules(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def module_edges(root: Path = ROOT) -> list[Edge]:
    """Every import of another node's module, one edge per import statement."""
    edges = []
    for package in PACKAGES:
        if not (root / package).is_dir():
            continue
        for path in sorted((root / package).rglob("*.py")):
            rel = str(path.relative_to(root))
            tree = ast.parse(path.read_text(), rel)
            for name in _imported_modules(tree):
                parts = name.split(".")
                if parts[0] != "rung" or len(parts) < 2:
                    continue
                target = _node(f"{parts[1]}/{'/'.join(parts[2:])}.py")
                if target != _node(rel):
                    edges.append((_node(rel), target, f"{rel} imports {name}"))
    return edges


def package_graph(edges: list[Edge]) -> dict[str, collections.Counter]:
    graph: dict[str, collections.Counter] = {n: collections.Counter() for n in NODES}
    for source, target, _ in edges:
        graph[source][target] += 1
    return graph


def violations(edges: list[Edge]) -> list[str]:
    """One line per import that goes against the layering."""
    bad = []
    for source, target, what in edges:
        module = what.split(" imports ")[1]
        if target not in ALLOWED[source]:
            bad.append(f"{what} ({source} may import "
                       f"{', '.join(sorted(ALLOWED[source])) or 'nothing'})")
        elif source in PUBLIC_ONLY and module not in PUBLIC_ONLY[source]:
            bad.append(f"{what} ({source} may import only "
                       f"{', '.join(sorted(PUBLIC_ONLY[source]))})")
    return bad


def find_cycle(graph: dict[str, collections.Counter]) -> list[str] | None:
    """A package cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}            # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in graph.get(node, {}):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for start in graph:
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def main(argv: list[str]) -> int:
    edges = module_edges(Path(argv[0]) if argv else ROOT)
    graph = package_graph(edges)
    for package in NODES:
        targets = ", ".join(f"{t} ({n})" for t, n in sorted(graph[package].items()))
        print(f"{package:<8} -> {targets or '(nothing)'}")
    cycle = find_cycle(graph)
    bad = violations(edges)
    print("cycle: " + (" -> ".join(cycle) if cycle else "none"))
    print(f"imports against the layering: {len(bad)}")
    for line in bad:
        print(f"  {line}")
    return 1 if cycle or bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
