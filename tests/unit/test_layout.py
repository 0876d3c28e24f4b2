"""The layout's rule, as each folder's __init__.py states it: which packages a package may import,
no import circle between modules, and a pure core. Reads every module's imports (an AST walk: at
module level and inside functions alike, since a deferred import is still an arrow; only what sits
under `if TYPE_CHECKING:` is left out, as it never runs). The code passes ruff (pyproject.toml)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {  # import name -> folder
    "svip_common": "svip_common", "svip_proto": "proto/svip_proto", "svip_runtime": "svip_runtime",
    "target_worker": "target_worker", "draft_worker": "draft_worker", "coordinator": "coordinator",
    "svip_serve": "deploy/svip_serve", "training": "training", "svip_assets": "svip_assets",
    "svip_bench": "svip_bench", "svip_cli": "svip_cli",
}
CORE = ("svip_common",)
ALLOWED = {  # package -> the packages it may import (besides itself)
    "svip_common": set(),
    "svip_proto": {"svip_common"},
    "target_worker": {"svip_common"},
    "svip_runtime": {"svip_common", "svip_proto"},
    "draft_worker": {"svip_common", "svip_proto", "svip_runtime"},
    "coordinator": {"svip_common", "svip_proto", "svip_runtime", "draft_worker", "target_worker"},
    "svip_assets": {"svip_common"},
    "svip_serve": {"svip_common", "svip_proto", "svip_runtime", "coordinator", "svip_assets"},
    "training": {"svip_common", "svip_proto", "svip_runtime", "draft_worker", "target_worker", "coordinator",
                 "svip_assets", "svip_bench"},
    "svip_bench": {"svip_common", "svip_proto", "svip_runtime", "draft_worker", "target_worker", "coordinator",
                   "svip_serve", "svip_assets"},
    "svip_cli": set(PACKAGES) - {"svip_cli"},
}
SESSION = "coordinator.session"
IN_PROCESS = ("coordinator.engine", "coordinator.batch")
EDGES = ("coordinator.session.host", "coordinator.session.draft_port", "coordinator.session.draft_link",
         "coordinator.session.caller_events", "coordinator.session.actor")  # where the session package meets
# the wire and Ray
FORBIDDEN_IN_CORE = ("grpc", "ray", "svip_proto", "google.protobuf")


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in (REPO / folder).rglob("*.py"):
            if "_pb2" in path.name:
                continue
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            out[name] = path
    return out


def _imports(path: Path, for_types: bool = False) -> set[str]:
    """Every module name an import in the file names, except under `if TYPE_CHECKING:` (unless
    for_types: a module that needs another's types only still depends on it)."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if not for_types and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


MODULES = _modules()
GRAPH = {name: {t for t in _imports(path) if t in MODULES and t != name} for name, path in MODULES.items()}
TYPED_GRAPH = {name: {t for t in _imports(path, True) if t in MODULES and t != name} for name, path in MODULES.items()}


def _package(module: str) -> str:
    return module.split(".")[0]


def test_every_folder_states_its_rule():
    for package, folder in PACKAGES.items():
        init = REPO / folder / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc and "run" in doc.lower(), f"{init} does not say what runs it and what it may import"


def test_packages_import_only_what_their_rule_allows():
    wrong = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets
                   if _package(t) != _package(m) and _package(t) not in ALLOWED[_package(m)])
    assert not wrong, wrong


def test_the_core_imports_no_grpc_ray_or_generated_code():
    wrong = sorted(
        f"{m} imports {name}"
        for m, path in MODULES.items()
        if _package(m) in CORE
        for name in _imports(path)
        if name.split(".")[0] in FORBIDDEN_IN_CORE or name.startswith("svip_proto")
    )
    assert not wrong, wrong


def test_the_session_package_stays_apart_from_the_rest_of_the_coordinator():
    wrong = sorted(
        f"{m} -> {t}"
        for m, targets in GRAPH.items()
        for t in targets
        if (m.startswith(SESSION) and _package(t) == "coordinator" and not t.startswith(SESSION))
        or (m.startswith(IN_PROCESS) and t.startswith(SESSION))
    )
    assert not wrong, wrong


def test_the_sessions_protocol_logic_speaks_the_domain():
    """Both sides' session logic reads and writes svip_common.messages; protobuf, gRPC and Ray stay
    at the services' edges (host.py, draft_port.py and caller_events.py on the target side,
    service.py on the draft's)."""
    logic = [m for m in MODULES if m.startswith(SESSION + ".") and m not in EDGES] + ["draft_worker.pipelined"]
    wrong = sorted(
        f"{m} imports {name}"
        for m in logic
        for name in _imports(MODULES[m])
        if name.split(".")[0] in (*FORBIDDEN_IN_CORE, "svip_runtime")
    )
    assert len(logic) >= 7 and not wrong, wrong


def test_no_import_circles():
    """Not even through imports for type checking only."""
    cycles, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(TYPED_GRAPH[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for module in sorted(TYPED_GRAPH):
        if module not in state:
            visit(module)
    assert not cycles, cycles


def test_the_code_passes_ruff():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is a test dependency (pip install -e '.[test]')"
    run = subprocess.run([ruff, "check", "--quiet", str(REPO)], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-1000:]


def _loaded_after(imports: str, watched: tuple[str, ...]) -> str:
    """Which of ``watched`` a fresh interpreter has loaded after running ``imports``."""
    code = f"import sys\n{imports}\nprint(sorted(m for m in {watched!r} if m in sys.modules))\n"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip()


def test_the_command_line_answers_without_loading_the_model_stack():
    """`svip --help`, a bad flag, and `svip serve`'s settings need no torch or transformers (they
    took 6 s to load here before the command could answer)."""
    imports = "from svip_cli.main import build_parser\nimport svip_serve.local, svip_serve.settings\nbuild_parser()"
    assert _loaded_after(imports, ("torch", "transformers", "ray")) == "[]"


def test_processes_that_host_no_model_load_no_modeling_stack():
    """A Serve replica, `svip serve`'s driver and `svip generate --mode distributed`'s caller need a
    tokenizer and a model's limits, never its weights: transformers' modeling stack (torch.distributed,
    dynamo, scipy: ~3.5 s of imports on this machine, in each such process) stays unloaded."""
    imports = ("import svip_serve.app, svip_serve.server, svip_serve.local, svip_serve.metrics\n"
               "import coordinator.cluster, coordinator.distributed, coordinator.client")
    assert _loaded_after(imports, ("transformers.modeling_utils", "torch._dynamo", "scipy")) == "[]"


def test_the_port_ray_keeps_for_its_agent_is_rays():
    """The metrics port that svip serve refuses, and that the tests never draw, is the one Ray's
    dashboard agent takes whatever ray.init is told."""
    from ray._private.ray_constants import DEFAULT_DASHBOARD_AGENT_LISTEN_PORT

    from coordinator.cluster import RAY_AGENT_PORT
    from tests.serving import RAY_AGENT_PORT as TESTS_AVOID

    assert RAY_AGENT_PORT == TESTS_AVOID == DEFAULT_DASHBOARD_AGENT_LISTEN_PORT


MAX_CLASS_LINES = 300


def test_no_class_is_longer_than_a_reader_holds():
    """A class past MAX_CLASS_LINES is split by what it does (the session's parts, the host's pages
    and idle work, the server's request shaping are examples)."""
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long


MAX_PARSER_LINES = 60


def test_the_parsers_are_built_from_declarations_not_written_out():
    """The CLI's parsers take the knobs' flags from their declaration (svip_common/knobs.py): a
    function that builds a parser stays short, and no product code reads a flag through
    getattr(args, name, default), a second default."""
    builders = []
    fallbacks = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and ("parser" in node.name or node.name == "add_arguments"):
                if node.end_lineno - node.lineno + 1 > MAX_PARSER_LINES and name.startswith("svip_cli"):
                    builders.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and len(node.args) == 3 and isinstance(node.args[0], ast.Name) and node.args[0].id == "args"):
                fallbacks.append(f"{name}:{node.lineno}")
    assert not builders, builders
    assert not fallbacks, f"getattr(args, ..., default) gives a knob a second default: {fallbacks}"


def test_the_sessions_parts_read_only_the_state_it_declares():
    """Each part of SessionPipeline (attachment.py, waiting.py, speculation.py, pipeline.py) reads
    fields and calls steps that it defines itself or that SessionState (state.py) declares: no
    part reads another's undeclared names."""
    state = ast.parse(MODULES["coordinator.session.state"].read_text())
    effects = ast.parse(MODULES["coordinator.session.effects"].read_text())
    declared = _defined(state) | _defined(effects) | {"now", "_effects"}
    undeclared = []
    for part in ("attachment", "waiting", "speculation", "pipeline"):
        tree = ast.parse(MODULES[f"coordinator.session.{part}"].read_text())
        own = _defined(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                if node.attr not in own | declared:
                    undeclared.append(f"{part}.py:{node.lineno} self.{node.attr}")
    assert not undeclared, undeclared


def _defined(tree: ast.Module) -> set[str]:
    """The names a module's classes define: their methods and properties, and the fields their
    methods assign to self."""
    names = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for item in cls.body:
            if isinstance(item, ast.FunctionDef):
                names.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names.add(item.target.id)
        for node in ast.walk(cls):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for t in ast.walk(target):
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            names.add(t.attr)
    return names
