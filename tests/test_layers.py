"""The import directions of docs/architecture.md, checked by walking every module's imports."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import servelm

ROOT = Path(servelm.__file__).parent


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def modules():
    for path in ROOT.rglob("*.py"):
        yield path.relative_to(ROOT.parent).with_suffix("").as_posix().replace("/", "."), path


def starts(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_only_the_llamacpp_runner_imports_llama_cpp():
    """runners/llamacpp.py (the model, its contexts) and runners/media.py (libmtmd's projector) own every pointer."""
    owners = ("servelm.runners.llamacpp", "servelm.runners.media")
    bad = [m for m, p in modules() if m not in owners and any(starts(i, "llama_cpp") for i in imports_of(p))]
    assert not bad


def test_only_http_imports_fastapi_or_starlette():
    bad = [m for m, p in modules()
           if not starts(m, "servelm.http") and any(starts(i, "fastapi", "starlette", "uvicorn") for i in imports_of(p))
           and m != "servelm.__main__"]
    assert not bad


def test_engine_sees_no_protocol_no_http_no_pydantic():
    for m, p in modules():
        if starts(m, "servelm.engine", "servelm.runners"):
            imported = imports_of(p)
            assert not any(starts(i, "servelm.protocol", "servelm.http", "servelm.service", "pydantic", "fastapi") for i in imported), m


def test_service_does_not_reach_into_the_engine_internals_or_runners():
    allowed_engine = ("servelm.engine.base", "servelm.engine.types", "servelm.engine.wrappers")
    for m, p in modules():
        if starts(m, "servelm.service", "servelm.protocol", "servelm.chat"):
            for i in imports_of(p):
                assert not starts(i, "servelm.runners", "servelm.http"), (m, i)
                if starts(i, "servelm.engine"):
                    assert starts(i, *allowed_engine), (m, i)


def test_engine_wrappers_see_only_the_engine_protocol():
    """engine/wrappers/: Engines around another, knowing the engine only by its protocol and value types (and
    servelm.tracing, a leaf, for the traced one)."""
    for m, p in modules():
        if starts(m, "servelm.engine.wrappers"):
            mine = [i for i in imports_of(p) if starts(i, "servelm")]
            assert all(i == "servelm" or starts(i, "servelm.engine.base", "servelm.engine.types",
                                                 "servelm.engine.wrappers", "servelm.errors") for i in mine), (m, mine)


def test_service_rooms():
    """service/registry/ holds deployments and their lifecycle, service/safety/ the content-filter pipeline: neither
    imports an endpoint service. The registry reaches only the data a deployment carries (its policy, its image
    input); the safety pipeline reaches the registry and the rendering of messages into a prompt (its guard's)."""
    rooms = {"servelm.service.registry": ("servelm.service.registry", "servelm.service.safety.policy",
                                          "servelm.service.media"),
             "servelm.service.safety": ("servelm.service.safety", "servelm.service.registry",
                                        "servelm.service.messages")}
    for m, p in modules():
        for room, allowed in rooms.items():
            if starts(m, room):
                service = [i for i in imports_of(p) if starts(i, "servelm.service")]
                assert all(starts(i, *allowed) for i in service), (m, service)


def test_leaves_import_nothing_of_servelm():
    """engine.types carries constrain's Constraint value, and nothing else of servelm."""
    for leaf, allowed in (("servelm.errors", ()), ("servelm.config", ()), ("servelm.metrics", ()), ("servelm.aio", ()),
                          ("servelm.keys", ()), ("servelm.models", ("servelm.config",)),
                          ("servelm.constrain.constraint", ()), ("servelm.engine.types", ("servelm.constrain.constraint",))):
        path = ROOT.parent / (leaf.replace(".", "/") + ".py")
        assert not [i for i in imports_of(path) if starts(i, "servelm") and i not in allowed], leaf


def test_bench_is_a_client_of_any_server():
    """servelm.bench measures servers over HTTP: it needs nothing of servelm's own, and only the CLI reaches it."""
    for m, p in modules():
        mine = [i for i in imports_of(p) if starts(i, "servelm")]
        if starts(m, "servelm.bench"):
            assert all(starts(i, "servelm.bench") for i in mine), (m, mine)
        elif m != "servelm.__main__":
            assert not any(starts(i, "servelm.bench") for i in mine), (m, mine)


def test_only_servelm_ray_imports_ray():
    """Ray is an optional extra: the core imports it nowhere (__main__ reaches servelm.ray only for --ray)."""
    bad = [m for m, p in modules() if not starts(m, "servelm.ray") and any(starts(i, "ray") for i in imports_of(p))]
    assert not bad


def test_runners_know_the_engine_only_through_the_plan():
    """A runner is given a StepPlan and implements engine/runner.py's protocol; the scheduler, the slots and the loop
    are none of its business, and the engine knows runners only through that protocol."""
    for m, p in modules():
        if starts(m, "servelm.runners"):
            engine = [i for i in imports_of(p) if starts(i, "servelm.engine")]
            assert all(i in ("servelm.engine.plan", "servelm.engine.runner") for i in engine), (m, engine)
            assert not any(starts(i, "servelm.service", "servelm.http", "servelm.constrain") for i in imports_of(p)), m
        if starts(m, "servelm.engine"):
            assert not any(starts(i, "servelm.runners") for i in imports_of(p)), m


def test_speculation_is_pure_data_over_the_plan():
    """engine/speculate.py drafts from a sequence's own tokens and weighs a plan: it needs the plan and nothing else
    (no runner, no other request's state)."""
    path = ROOT / "engine" / "speculate.py"
    assert [i for i in imports_of(path) if starts(i, "servelm")] == ["servelm.engine.plan"]


def test_the_spill_tiers_know_only_the_slots_prefix_matching():
    """engine/spill.py keeps bytes and files; the scheduler decides what goes there, the runner fills the bytes. It
    opens its files as untrusted ones (gguf_header's open_regular, a leaf)."""
    path = ROOT / "engine" / "spill.py"
    assert {i for i in imports_of(path) if starts(i, "servelm")} == {"servelm.engine.slots", "servelm.gguf_header"}


def test_the_prefix_cache_stands_apart_from_the_scheduler():
    """engine/prefix_cache.py owns the slots, the spill store and the copies pending; it answers the scheduler and
    never knows it (its KV operations, the sequences it places, the slots and the spill tiers only)."""
    path = ROOT / "engine" / "prefix_cache.py"
    mine = {i for i in imports_of(path) if starts(i, "servelm")}
    assert mine == {"servelm.engine.plan", "servelm.engine.sequence", "servelm.engine.slots", "servelm.engine.spill"}


def test_constrain_imports_nothing_of_the_engine():
    """constrain/ makes the Constraint the engine carries; it knows nothing of the engine that carries it."""
    for m, p in modules():
        if starts(m, "servelm.constrain"):
            assert not any(starts(i, "servelm.engine", "servelm.service", "servelm.http", "servelm.runners") for i in imports_of(p)), m


def test_nothing_but_main_imports_ray_mode_or_compose():
    """The wiring (compose, and the fleet that builds with it) and the Ray mode sit on top: no layer below them
    imports them."""
    for m, p in modules():
        if starts(m, "servelm.engine", "servelm.runners", "servelm.service", "servelm.http", "servelm.protocol",
                  "servelm.chat", "servelm.constrain"):
            assert not any(starts(i, "servelm.compose", "servelm.fleet", "servelm.ray") for i in imports_of(p)), m


def test_errors_are_rendered_only_in_http_errors():
    """The envelope (and Azure ML's shape) is built in one place: nothing else calls ApiError.body()."""
    rendering = re.compile(r"(?<!request)\.body\(\)")  # an ApiError's body(), not a Starlette request's
    bad = [m for m, p in modules() if m not in ("servelm.http.errors", "servelm.errors") and rendering.search(p.read_text())]
    assert not bad


def _imports_all(path: Path, name: str) -> set[str]:
    """Every servelm module a module imports, wherever the import is (type-only and in functions too), relative
    imports resolved, `from package import module` counted as the module."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def test_no_import_circle_anywhere():
    """Drawn as floors, every module stands above what it imports: no loop, type-only imports included."""
    names = {}
    for m, p in modules():
        names[m.removesuffix(".__init__")] = p
    graph = {m: {i for i in _imports_all(p, m) if i in names and i != m} for m, p in names.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for i in sorted(graph[m]):
            if state.get(i) == 1:
                raise AssertionError("import circle: " + " → ".join(path[path.index(i):] + [i]))
            if i not in state:
                visit(i)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_output_processor_does_not_know_the_scheduler():
    """engine/output.py turns sampled tokens into outputs and events; the scheduler applies them (Scheduler.update)."""
    for module in ("output", "sampler", "choice"):
        path = ROOT / "engine" / f"{module}.py"
        assert "servelm.engine.scheduler" not in _imports_all(path, f"servelm.engine.{module}"), module


def test_sequence_imports_nothing_above_it():
    """engine/sequence.py is the scheduler's record of a sequence: it knows the plan's key type, the value types and
    the drafter's state, nothing of the stages that read it."""
    path = ROOT / "engine" / "sequence.py"
    mine = {i for i in imports_of(path) if starts(i, "servelm")}
    assert mine <= {"servelm.engine.plan", "servelm.engine.speculate", "servelm.engine.types"}, mine


def test_only_scheduler_update_changes_a_sequences_state():
    """A sequence's status, slot, tokens and computed cells are assigned in engine/scheduler.py alone (add, abort,
    schedule, update and their helpers), nowhere else in the package."""
    fields = {"status", "slot", "num_computed", "token_ids", "drafter", "cached_tokens", "started_at"}
    bad = []
    for m, p in modules():
        if m == "servelm.engine.scheduler" or m == "servelm.engine.sequence":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in fields and isinstance(t.value, ast.Name) \
                        and t.value.id in {"seq", "sequence", "group", "sampler", "child", "parent"}:
                    bad.append((m, t.value.id, t.attr, node.lineno))
    assert not bad


def test_the_steps_values_are_typed_through():
    """The step's modules name no `Any`: a chunk's sequence is a SeqKey, a request's outputs a list or its error, a
    matcher llguidance's LLMatcher (the one third-party object the stages hold, in engine/choice.py)."""
    for module in ("plan", "scheduler", "sampler", "output", "choice", "local", "sequence"):
        tree = ast.parse((ROOT / "engine" / f"{module}.py").read_text())
        assert not [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "Any"], module
