"""Package imports form a DAG: runtime -> graphs/models -> kernels -> core (no upward import),
and no modules import each other in a loop, inside a package or across, type-only included.

The layering is defined and explained in rung.bench.import_graph; print the graph with
``python -m rung.bench.import_graph``.
"""

from rung.bench.import_graph import (
    ROOMS,
    ROOT,
    find_cycle,
    module_cycles,
    module_edges,
    module_graph,
    package_graph,
    violations,
)


def test_no_package_imports_a_higher_layer():
    assert violations(module_edges()) == []


def test_package_graph_has_no_cycle():
    assert find_cycle(package_graph(module_edges())) is None


def test_no_modules_import_each_other_in_a_loop():
    assert module_cycles(module_graph()) == []


def test_a_type_only_loop_inside_a_package_is_caught(tmp_path):
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "app.py").write_text(
        "from rung.server.streaming import stream\nclass Server: ...\n")
    (tmp_path / "server" / "streaming.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from rung.server.app import Server\n")
    (tmp_path / "server" / "ok.py").write_text("from rung.server import app\n")
    assert module_cycles(module_graph(tmp_path)) == [["server/app.py", "server/streaming.py"]]
    assert find_cycle(package_graph(module_edges(tmp_path))) is None   # one package


def test_a_loop_through_a_package_init_is_caught(tmp_path):
    (tmp_path / "runtime" / "engine").mkdir(parents=True)
    (tmp_path / "runtime" / "engine" / "__init__.py").write_text(
        "from rung.runtime.engine.llm_engine import LLMEngine\n")
    (tmp_path / "runtime" / "engine" / "llm_engine.py").write_text(
        "from rung.runtime.engine.startup import load\n")
    (tmp_path / "runtime" / "engine" / "startup.py").write_text(
        "def load():\n    from rung.runtime.engine import LLMEngine\n")
    assert module_cycles(module_graph(tmp_path)) == [[
        "runtime/engine/__init__.py", "runtime/engine/llm_engine.py",
        "runtime/engine/startup.py"]]


def test_every_library_module_is_read():
    edges = module_edges()
    sources = {what.split(" ")[0] for _, _, what in edges}
    assert {"kernels/attention.py", "graphs/manager.py",
            "runtime/engine/llm_engine.py"} <= sources
    assert (ROOT / "core" / "descriptor.py").exists()


def test_every_runtime_room_is_a_node_of_its_own():
    edges = module_edges()
    linked = {node for source, target, _ in edges for node in (source, target)}
    assert {f"runtime/{room}" for room in ROOMS} <= linked
    graph = package_graph(edges)
    assert {"runtime/sched", "runtime/worker"} <= set(graph["runtime/engine"])


def test_a_room_importing_a_room_above_it_is_caught(tmp_path):
    for folder in ("runtime/sched", "runtime/engine"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "runtime" / "sched" / "bad.py").write_text(
        "from rung.runtime.engine.llm_engine import LLMEngine\n")
    (tmp_path / "runtime" / "engine" / "ok.py").write_text("import rung.runtime.sched.bad\n")
    edges = module_edges(tmp_path)
    assert violations(edges) == [
        "runtime/sched/bad.py imports rung.runtime.engine.llm_engine "
        "(runtime/sched may import core, runtime)"]
    assert find_cycle(package_graph(edges)) is not None


def test_an_upward_import_is_caught_even_under_type_checking(tmp_path):
    for package in ("core", "kernels", "models", "graphs", "runtime", "bench"):
        (tmp_path / package).mkdir()
    (tmp_path / "kernels" / "bad.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from rung.runtime.model_runner import ModelRunner\n")
    (tmp_path / "runtime" / "ok.py").write_text("import rung.kernels.bad\n")
    edges = module_edges(tmp_path)
    assert violations(edges) == [
        "kernels/bad.py imports rung.runtime.model_runner (kernels may import core)"]
    assert find_cycle(package_graph(edges)) in (["kernels", "runtime", "kernels"],
                                                 ["runtime", "kernels", "runtime"])


def test_the_server_sits_on_the_public_api_and_only_the_cli_imports_it(tmp_path):
    for package in ("runtime", "bench", "server", "cli"):
        (tmp_path / package).mkdir()
    (tmp_path / "server" / "ok.py").write_text("from rung.runtime import LLMEngine\n")
    (tmp_path / "server" / "deep.py").write_text("from rung.runtime.engine import LLMEngine\n")
    (tmp_path / "bench" / "up.py").write_text("import rung.server.app\n")
    (tmp_path / "cli" / "main.py").write_text("from rung.server.app import run_server\n")
    assert violations(module_edges(tmp_path)) == [
        "bench/up.py imports rung.server.app (bench may import core, graphs, kernels, "
        "models, runtime)",
        "server/deep.py imports rung.runtime.engine (server may import only rung.runtime)"]


def test_the_graph_manager_sees_its_backend_only_through_the_interface():
    """graphs/manager.py asks no ``isinstance`` of a backend or a graph, and only the backend
    factory (graphs/backends.py) reaches into compiled CPU graphs' room."""
    import ast

    source = (ROOT / "graphs" / "manager.py").read_text()
    asked = [ast.unparse(node) for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
             and any(name.endswith(("Backend", "Graph"))
                     for name in ast.unparse(node.args[1]).replace("(", " ").replace(
                         ")", " ").replace(",", " ").split())]
    assert asked == []
    graph = module_graph()
    reaching = sorted(source for source, targets in graph.items()
                      if source.startswith("graphs/") and "/cpu_compiled/" not in source
                      and any(t.startswith("graphs/cpu_compiled/") for t in targets))
    assert reaching == ["graphs/backends.py"]
