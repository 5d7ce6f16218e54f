"""The package import graph of rung, read from the source with `ast` (nothing is imported).

    python -m rung.bench.import_graph [ROOT]      # ROOT: a checkout, this one by default

Prints one line per package: the rung packages it imports and how many import statements
do so, then whether the graph keeps to the layering, whether the packages form a cycle,
and whether any modules do (a loop inside one package counts: ``a.py`` imports ``b.py``
imports ``a.py``). Every import counts, including those under ``if TYPE_CHECKING:`` and
inside functions: a type-only import is still a dependency a reader has to hold in mind,
and a type-only loop says a shared type sits in the wrong module.

The layering (each node may import only the nodes listed for it):

    core     -> (nothing)            descriptor, graph modes, KV cache spec, metadata, context
    kernels  -> core                 attention backends and kernels
    models   -> kernels, core        model definitions and weight loading
    graphs   -> kernels, core        ladder, dispatcher, capture, compiler, graph manager
    runtime  -> graphs, models, kernels, core
                                     runtime/*.py: what every room shares (config, sampling
                                     params, outputs, detokenizer, logging); runtime/ROOM/
                                     are nodes of their own:
      runtime/sched  -> runtime, core           scheduler, KV cache manager, requests
      runtime/dist   -> runtime, core           data parallel groups, collectives
      runtime/worker -> runtime/sched and below model runner, input batch, samplers
      runtime/spec   -> runtime/worker and below  n-gram and MTP proposers
      runtime/engine -> runtime/spec, runtime/worker, runtime/sched, runtime/dist and below
      runtime/api    -> runtime/engine, runtime/dist, runtime, models, core   LLM
      runtime/tools  -> runtime/api, runtime/engine and below    verify, warmup
    bench    -> runtime and below    tools and benchmarks, never imported by the library
    server   -> runtime (public API) `rung serve`: imports only the module ``rung.runtime``
                                     (LLMEngine's step API, SamplingParams, outputs), so it
                                     stays a tool on top of the engine, never a second one
    cli      -> anything             cli/, the `rung` console entry point: the one package
                                     above bench and server (`rung bench` runs
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
PACKAGES = ("core", "kernels", "models", "graphs", "runtime", "bench", "server", "cli")
ROOMS = ("sched", "dist", "worker", "spec", "engine", "api", "tools")   # runtime/ROOM/
_BELOW_WORKER = {"runtime", "graphs", "models", "kernels", "core"}
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "kernels": {"core"},
    "models": {"kernels", "core"},
    "graphs": {"kernels", "core"},
    "runtime": {"graphs", "models", "kernels", "core"},
    "runtime/sched": {"runtime", "core"},
    "runtime/dist": {"runtime", "core"},
    "runtime/worker": {"runtime/sched"} | _BELOW_WORKER,
    "runtime/spec": {"runtime/worker", "runtime/sched"} | _BELOW_WORKER,
    "runtime/engine": {"runtime/spec", "runtime/worker", "runtime/sched", "runtime/dist"}
    | _BELOW_WORKER,
    "runtime/api": {"runtime/engine", "runtime/dist", "runtime", "models", "core"},
    "runtime/tools": {"runtime/api", "runtime/engine"} | _BELOW_WORKER,
}
ALLOWED["bench"] = {n for n in ALLOWED if n.startswith("runtime")} | _BELOW_WORKER
ALLOWED["server"] = {"runtime"}
ALLOWED["cli"] = set(ALLOWED)
NODES = tuple(ALLOWED)
# packages that may import only these modules of what ALLOWED lets them import
PUBLIC_ONLY: dict[str, set[str]] = {"server": {"rung.runtime"}}

Edge = tuple[str, str, str]          # (importing node, imported node, "file imports module")


def _node(path: str) -> str:
    """runtime/api/llm.py -> 'runtime/api', runtime/engine/x.py -> 'runtime/engine',
    runtime/config.py -> 'runtime', graphs/manager.py -> 'graphs'."""
    parts = path.removesuffix(".py").split("/")
    if parts[0] == "runtime" and len(parts) > 1 and parts[1] in ROOMS:
        return f"runtime/{parts[1]}"
    return parts[0]


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


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Every rung module (by its file, e.g. ``graphs/manager.py``, a package by its
    ``__init__.py``) -> the rung modules it imports. ``from rung.a import b`` imports the
    module ``a/b.py`` when there is one, else (a name defined in it) ``a``."""
    files = {}
    for package in PACKAGES:
        if (root / package).is_dir():
            for path in sorted((root / package).rglob("*.py")):
                rel = str(path.relative_to(root))
                files[_module_name(rel)] = rel
    graph: dict[str, set[str]] = {rel: set() for rel in files.values()}
    for name, rel in files.items():
        for node in ast.walk(ast.parse((root / rel).read_text(), rel)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{alias.name}"
                           if f"{node.module}.{alias.name}" in files else node.module
                           for alias in node.names]
            else:
                continue
            graph[rel].update(files[t] for t in targets if t in files and t != name)
    return graph


def _module_name(rel: str) -> str:
    """graphs/manager.py -> rung.graphs.manager, runtime/engine/__init__.py ->
    rung.runtime.engine."""
    return "rung." + rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import loop between modules: the strongly connected components of more than one
    module (Tarjan's algorithm, iterative), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    loops = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    loops.append(sorted(component))
    return sorted(loops)


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
        allowed = ALLOWED[source]
        if source in PUBLIC_ONLY:          # judged by package; then by module
            target = target.split("/")[0]
        if target not in allowed:
            bad.append(f"{what} ({source} may import {_names(source, allowed)})")
        elif source in PUBLIC_ONLY and module not in PUBLIC_ONLY[source]:
            bad.append(f"{what} ({source} may import only "
                       f"{', '.join(sorted(PUBLIC_ONLY[source]))})")
    return bad


def _names(source: str, allowed: set[str]) -> str:
    """A package outside runtime/ is told the packages it may import; a room, the rooms."""
    if not source.startswith("runtime/"):
        allowed = {n.split("/")[0] for n in allowed}
    return ", ".join(sorted(allowed)) or "nothing"


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
    root = Path(argv[0]) if argv else ROOT
    edges = module_edges(root)
    graph = package_graph(edges)
    for package in NODES:
        targets = ", ".join(f"{t} ({n})" for t, n in sorted(graph[package].items()))
        print(f"{package:<14} -> {targets or '(nothing)'}")
    cycle = find_cycle(graph)
    bad = violations(edges)
    print("cycle: " + (" -> ".join(cycle) if cycle else "none"))
    loops = module_cycles(module_graph(root))
    print(f"import loops between modules: {len(loops)}")
    for loop in loops:
        print(f"  {', '.join(loop)}")
    print(f"imports against the layering: {len(bad)}")
    for line in bad:
        print(f"  {line}")
    return 1 if cycle or loops or bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
