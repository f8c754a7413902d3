"""The import graph keeps the architecture's floors, by folder: the foundations (`baton/`), the
services on them, and on top the launchers (`launch/`), the benchmarks (`bench/`) and the command
line (`cli/`), in that order. No circle, nothing reaches up a floor, and the policy modules stay
plain Python (read from the source, nothing is imported)."""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The top floor's rooms, lowest first: each imports the services and the rooms before it only.
TOP = ("baton.launch", "baton.bench", "baton.cli")
# Policy: plain Python over ints and lists (docs/architecture.md).
POLICY = ["baton.decode_worker.scheduler", "baton.decode_worker.kv_pages", "baton.router.admission",
          "baton.prefill_worker.batching", "baton.prefill_worker.prefix_cache",
          "baton.router.policy", "baton.router.openai_api.protocol",
          "baton.router.batch_planner", "baton.router.prefix_index.base", "baton.router.prefix_index.memory",
          "baton.planner.policy", "baton.planner.simulator"]
HEAVY = ("torch", "grpc", "redis", "kubernetes", "numpy", "transformers")


def modules() -> dict[str, Path]:
    """Every module of the installed namespace, from pyproject's package-dir mapping."""
    folders = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = {}
    for package, folder in folders.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imports(path: Path) -> set[str]:
    """Absolute module names a file imports, anywhere in it (lazy imports count too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def folder_of() -> dict[str, str]:
    """Each module's top-level folder (its room)."""
    return {name: path.relative_to(REPO).parts[0] for name, path in modules().items()}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {dep for dep in imports(path) if dep in known and dep != name} for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
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
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back_in_a_circle():
    assert cycles(graph()) == []


def test_the_foundations_import_only_the_foundations():
    room = folder_of()
    bottom = {name for name, folder in room.items() if folder == "baton"}
    assert {"baton.config", "baton.auth", "baton.metrics", "baton.v1.common_pb2"} <= bottom
    wrong = {name: sorted(dep for dep in deps if dep not in bottom) for name, deps in graph().items() if name in bottom}
    assert {name: deps for name, deps in wrong.items() if deps} == {}


def rank(name: str) -> int:
    """0 for the foundations and the services, then 1, 2, 3 up the top floor's rooms."""
    return next((i + 1 for i, top in enumerate(TOP) if name == top or name.startswith(top + ".")), 0)


def test_nothing_imports_a_room_above_it():
    wrong = {name: sorted(dep for dep in deps if rank(dep) > rank(name)) for name, deps in graph().items()}
    assert {name: deps for name, deps in wrong.items() if deps} == {}


def test_the_top_floor_is_the_launchers_the_benchmarks_and_the_command_line():
    room = folder_of()
    assert {room[top] for top in TOP} == {"launch", "bench", "cli"}
    assert "baton.cli.health_check" in room and "baton.launch.up" in room and "baton.bench.chaos" in room


def test_policy_modules_import_no_torch_grpc_redis_or_kubernetes():
    known = modules()
    policy = {name: path for name, path in known.items() if any(name == p or name.startswith(p + ".") for p in POLICY)}
    assert len(policy) >= len(POLICY)
    wrong = {name: sorted(dep for dep in imports(path) if dep.split(".")[0] in HEAVY) for name, path in policy.items()}
    assert {name: deps for name, deps in wrong.items() if deps} == {}


def test_the_prefill_loop_computes_and_leaves_delivery_to_the_delivery():
    """The loop schedules and computes; pushes, their threads and channels are KVDelivery's."""
    deps = graph()["baton.prefill_worker.loop"] | imports(modules()["baton.prefill_worker.loop"])
    assert not [d for d in deps if d.startswith(("baton.kvtransfer", "grpc", "baton.server"))]
    assert "baton.prefill_worker.delivery" in deps


def test_a_router_starts_without_torch():
    """The router tokenizes and routes: importing torch and transformers' model classes would cost
    every router start seconds of CPU for nothing (the built-in models' tokenizers included)."""
    code = ("import sys\nimport baton.router.service\nfrom baton.engine.model_files import load_tokenizer_view\n"
            "view = load_tokenizer_view('tiny-random')\nassert view.max_context == 2048 and view.vocab_size == 49152\n"
            "heavy = sorted(m for m in ('torch', 'transformers.models.llama') if m in sys.modules)\n"
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
