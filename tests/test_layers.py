"""The packages' imports point one way: infer/ at the bottom, heads/ on it, train/ on heads/, scripts/ on top; inside
train/, the applications (train/apps/) on training proper.

Read from the source with `ast` (function-level imports included), so a lazy import inside a function cannot
hide an arrow that runs back up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("infer", "heads", "train")
LAYER = {"infer": 0, "heads": 1, "train": 2, "scripts": 3}
# The one module of infer/ that loads trained drafters by name or folder (SelfSpecModel.from_pretrained).
FACADE = "infer/__init__.py"


def _sources() -> list[Path]:
    return sorted(p for d in (*PACKAGES, "scripts") for p in (ROOT / d).rglob("*.py"))


def _module_file(dotted: str) -> Path | None:
    """The file a dotted module name is, if it is one of ours."""
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts[:-1])


def _imports(path: Path, source: str | None = None) -> set[Path]:
    """The project files `path` imports (a submodule where `from package import name` names one)."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    here = _package_of(path)
    if path.name == "__init__.py":
        here = ".".join(path.relative_to(ROOT).parts[:-1])
    found: set[Path] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module
            names = [(module, alias.name) for alias in node.names]
        else:
            continue
        for module, name in names:
            sub = _module_file(f"{module}.{name}") if name else None
            target = sub or _module_file(module)
            if target is not None and target != path:
                found.add(target)
    return found


def _graph() -> dict[Path, set[Path]]:
    return {path: _imports(path) for path in _sources()}


def _layer(path: Path) -> str:
    return path.relative_to(ROOT).parts[0]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_no_file_imports_a_layer_above_its_own():
    upward = [f"{_rel(a)} -> {_rel(b)}" for a, targets in _graph().items() for b in targets
              if LAYER[_layer(b)] > LAYER[_layer(a)] and _rel(a) != FACADE]
    assert upward == [], upward


def test_only_the_facade_of_infer_reaches_above_it_and_nothing_in_infer_imports_it():
    graph = _graph()
    facade = ROOT / FACADE
    importers = [_rel(a) for a, targets in graph.items() if facade in targets and _layer(a) == "infer"]
    assert importers == [], importers


# Modules of infer/ that only infer/ may import: the engine and what it runs a call with (the request's checks,
# the policy that settles its plan, acceptance, the captured step), reached from outside through SelfSpecModel.
INFER_PRIVATE = ("infer/engine.py", "infer/request.py", "infer/policy.py", "infer/verify.py", "infer/cuda/")


def _private_names_from_infer(path: Path, source: str | None = None) -> list[str]:
    """Underscore names `path` imports from a module of infer/ (`from infer.kv import _buffer`)."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "infer":
            found += [f"{node.module}.{alias.name}" for alias in node.names if alias.name.startswith("_")]
    return found


def _private_reaches(graph: dict[Path, set[Path]], sources: dict[Path, str] | None = None) -> list[str]:
    reaches = []
    for a, targets in graph.items():
        if _layer(a) == "infer":
            continue
        reaches += [f"{_rel(a)} -> {_rel(b)}" for b in targets if _rel(b).startswith(INFER_PRIVATE)]
        reaches += [f"{_rel(a)} -> {name}" for name in _private_names_from_infer(a, (sources or {}).get(a))]
    return reaches


def test_nothing_outside_infer_imports_what_is_private_to_it():
    assert _private_reaches(_graph()) == []


@pytest.mark.parametrize("source", ["from infer.engine import Engine", "from infer.kv import _buffer",
                                    "from infer.cuda import graphs"])
def test_the_privacy_check_sees_each_reach(source, tmp_path):
    path = ROOT / "train" / "probe_not_a_file.py"
    graph = {path: _imports(path, source)}
    assert _private_reaches(graph, {path: source}), source


def test_no_import_circles():
    graph = _graph()
    circles = []
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()

    def visit(node: Path) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(_rel(top))
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert circles == [], circles


@pytest.mark.parametrize("source", ["import infer.engine", "from infer import engine", "from .engine import X"])
def test_the_reader_sees_each_form_of_import(source):
    assert ROOT / "infer" / "engine.py" in _imports(ROOT / "infer" / "probe.py", source)


# ---- train/apps/ apart from training proper ---------------------------------------------------------------

# The benchmark, serving, the demo and experiments: built on training proper (train/*.py), never under it.
APPS = "train/apps/"


def _reaches_into_apps(graph: dict[Path, set[Path]]) -> list[str]:
    return [f"{_rel(a)} -> {_rel(b)}" for a, targets in graph.items() for b in targets
            if _layer(a) == "train" and not _rel(a).startswith(APPS) and _rel(b).startswith(APPS)]


def test_training_proper_never_imports_the_applications():
    assert _reaches_into_apps(_graph()) == []


@pytest.mark.parametrize("source", ["from train.apps import bench", "import train.apps.serve",
                                    "from .apps.bench import cli"])
def test_the_apps_check_sees_each_reach(source):
    path = ROOT / "train" / "probe_not_a_file.py"
    assert _reaches_into_apps({path: _imports(path, source)}), source


# ---- scripts/ on top and thin ------------------------------------------------------------------------------

LOADERS = {"spec_from_file_location", "SourceFileLoader", "run_path"}  # ways to run a file as a module by its path
SCRIPT_CODE_LINES = 40  # argument parsing and one call into a module fit in far fewer


def _loads_scripts_by_path(source: str) -> list[str]:
    """The calls in `source` that load a file by path, or edit sys.path, with the scripts folder in them, written
    out or through a name assigned a path under it."""
    tree = ast.parse(source)
    named = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and "scripts" in ast.unparse(node.value).lower() for target in node.targets if isinstance(target, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            path_edit = isinstance(func, ast.Attribute) and ast.unparse(func.value) == "sys.path"
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            name, path_edit = "", any(ast.unparse(t).startswith("sys.path") for t in targets)
        else:
            continue
        segment = ast.get_source_segment(source, node) or ""
        points_at_scripts = "scripts" in segment.lower() or any(
            isinstance(n, ast.Name) and n.id in named for n in ast.walk(node))
        if (name in LOADERS or path_edit) and points_at_scripts:
            found.append(segment.splitlines()[0])
    return found


@pytest.mark.parametrize(("source", "flagged"), [
    ('spec = importlib.util.spec_from_file_location("x", ROOT / "scripts" / "serve.py")', True),
    ('spec = spec_from_file_location(f"_{name}", SCRIPTS / f"{name}.py")', True),
    ('sys.path.insert(0, str(ROOT / "scripts"))', True),
    ('sys.path += [SCRIPTS_DIR]', True),
    ('runpy.run_path("scripts/bench.py")', True),
    ('SERVE = ROOT / "scripts" / "serve.py"\nspec = spec_from_file_location("serve", SERVE)', True),
    ('from train.apps import serve\nsubprocess.run([sys.executable, "scripts/serve.py"])', False),
    ('spec_from_file_location("fixture", HERE / "data" / "plugin.py")', False),
])
def test_the_script_loader_check_sees_each_form(source, flagged):
    assert bool(_loads_scripts_by_path(source)) is flagged


def test_tests_never_load_scripts_by_file_path():
    """Tests import the module a script calls (train.apps.serve, heads.calibrate_cli, ...); running a script as the
    command it is (subprocess) is fine."""
    found = {p.name: hits for p in sorted((ROOT / "tests").glob("*.py"))
             if (hits := _loads_scripts_by_path(p.read_text()))}
    assert found == {}, found


def _script_problems(source: str) -> list[str]:
    """Why a script is not thin: more than SCRIPT_CODE_LINES lines of code, or a definition besides `main`."""
    tree = ast.parse(source)
    body = tree.body[1:] if ast.get_docstring(tree) is not None else tree.body
    code = {line for node in body for line in range(node.lineno, node.end_lineno + 1)
            if source.splitlines()[line - 1].strip() and not source.splitlines()[line - 1].strip().startswith("#")}
    problems = [f"{len(code)} lines of code (at most {SCRIPT_CODE_LINES})"] if len(code) > SCRIPT_CODE_LINES else []
    problems += [f"defines {node.name}" for node in ast.walk(tree)
                 if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name != "main"]
    return problems


def test_the_thinness_check_sees_a_fat_script():
    fat = '"""Doc."""\nimport sys\n\n\ndef helper():\n    return 1\n\n\n' + "x = 1\n" * 45
    assert _script_problems(fat) == ["48 lines of code (at most 40)", "defines helper"]
    assert _script_problems('"""Doc."""\n\nfrom train.apps.serve import main\n\nraise SystemExit(main())\n') == []


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "scripts").glob("*.py")))
def test_every_script_is_thin(script):
    """A script parses its arguments, or lets its module do it, and makes one call into a library module, where
    the work (and what tests import) lives."""
    assert _script_problems((ROOT / "scripts" / script).read_text()) == []
