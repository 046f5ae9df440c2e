"""The layering rules: `ingest` imports neither `actors` nor `jax_side` (nor Ray nor JAX);
`actors` never imports `jax`; the modules of the three packages import each other without a
cycle (every import counts, also inside functions), and none of the benchmarks, tests or
examples; outside the tests no module uses another module's underscore names, and private APIs
of other libraries only through the adapter modules: no private import, no underscore
attribute of theirs on any object (`jax._src`, `encoding._mergeable_ranks`), no underscore
keyword argument to their calls (`ray.init(_system_config=...)`), no private module named in a
call (`logging.getLogger("ray._private.worker")`)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_IN_INGEST = {"ray", "jax", "jaxlib", "actors", "jax_side"}
# jax_side imports jax, so importing it from actors would import jax too.
NOT_IN_ACTORS = {"jax", "jaxlib", "jax_side"}


def imported_modules(path: Path, *, dynamic: bool = False) -> list[tuple[int, str]]:
    """Top-level names of the modules a file imports anywhere in it (also inside functions),
    with line numbers: ``import``/``from`` statements, or with ``dynamic`` the literal names
    given to ``importlib.import_module``/``__import__``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if dynamic:
            if (isinstance(node, ast.Call) and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                    and (getattr(node.func, "attr", None) == "import_module"
                         or getattr(node.func, "id", None) in ("import_module", "__import__"))):
                found.append((node.lineno, node.args[0].value.split(".")[0]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def forbidden_imports(package: str, forbidden: set[str], *, dynamic: bool = False) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} imports {name}"
            for path in sorted((ROOT / package).rglob("*.py"))
            for line, name in imported_modules(path, dynamic=dynamic) if name in forbidden]


def test_importing_ingest_loads_neither_ray_nor_jax_nor_the_other_layers():
    code = ("import ingest, ingest.config, ingest.plan.build, ingest.stream.kinds, ingest.tokenize.tokenizer, sys; "
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(NOT_IN_INGEST)}); "
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_importing_the_ray_lifecycle_does_not_import_ray():
    # actors.ray_cluster sets the environment Ray reads when it is imported (loopback only,
    # authentication) and imports Ray on a thread of its own; importing it, or the actors
    # package, must leave Ray unimported.
    code = ("import actors, actors.ray_cluster, actors.private_api, sys; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_ingest_sources_import_neither_ray_nor_jax_nor_the_other_layers():
    assert list((ROOT / "ingest").glob("*.py")), "ingest/ has no modules"
    assert forbidden_imports("ingest", NOT_IN_INGEST) == []


def test_ingest_sources_do_not_reach_other_layers_through_importlib():
    # A lazy importlib.import_module("jax_side...") still makes ingest depend on that layer.
    assert forbidden_imports("ingest", NOT_IN_INGEST, dynamic=True) == []


def test_actors_sources_never_import_jax():
    # actors/ may not exist yet; then there is nothing to check.
    assert forbidden_imports("actors", NOT_IN_ACTORS) == []
    assert forbidden_imports("actors", NOT_IN_ACTORS, dynamic=True) == []


@pytest.mark.parametrize(("source", "dynamic"), [
    ("import jax.numpy as jnp", False), ("from jax import numpy", False),
    ("import os, ray", False), ("def f():\n    from actors.worker import Worker", False),
    ("importlib.import_module('jax_side.feed')", True), ("__import__('ray')", True),
])
def test_import_scan_sees_every_form_of_import(tmp_path, source, dynamic):
    path = tmp_path / "m.py"
    path.write_text(source + "\n")
    names = {name for _, name in imported_modules(path, dynamic=dynamic)}
    assert names & NOT_IN_INGEST


# -- the module graph -------------------------------------------------------------------------

LAYERS = ("ingest", "actors", "jax_side")
# Packages of the checkout that the product never imports (the CLI starts none of them).
NOT_IN_PRODUCT = {"benchmarks", "tests", "examples", "cluster"}
# Everything that may use private names of other libraries, one small adapter per layer.
PRIVATE_API_ADAPTERS = {"jax_side/private_api.py", "actors/private_api.py",
                        "benchmarks/private_api.py", "ingest/tokenize/private_api.py"}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(packages, root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


def import_statements(path: Path, root: Path = ROOT) -> list[tuple[int, str, list[str]]]:
    """Every import of a file, anywhere in it: ``(line, absolute module, names)``, where
    ``names`` are the names a ``from`` import takes (empty for ``import x``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path, root)
    package = package if path.name == "__init__.py" else package.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            found.append((node.lineno, module, [alias.name for alias in node.names]))
    return found


def _known(name: str, modules) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules``."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def module_graph(packages, root: Path = ROOT) -> dict[str, dict[str, int]]:
    """``{module: {imported project module: line}}`` over ``packages`` (submodules taken by
    ``from package import module`` count as imports of that submodule)."""
    modules = project_modules(packages, root)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for line, module, names in import_statements(path, root):
            for target in ({_known(f"{module}.{n}", modules) or _known(module, modules)
                            for n in names} or {_known(module, modules)}):
                if target and target != name:
                    edges.setdefault(target, line)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str]:
    """One import cycle of ``graph`` (``[a, b, ..., a]``), or ``[]``."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str]:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return []
        path.append(node)
        for target in sorted(graph.get(node, ())):
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return []

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return []


def describe_cycle(graph, cycle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:],
                                                                  strict=False)) + f" -> {cycle[-1]}"


def test_the_layers_have_no_import_cycle():
    graph = module_graph(LAYERS)
    assert len(graph) > 20, sorted(graph)
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + describe_cycle(graph, cycle)


def test_the_product_imports_no_benchmark_test_or_example_module():
    found = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in project_modules(LAYERS).values()
             for line, module, _ in import_statements(path)
             if module.split(".")[0] in NOT_IN_PRODUCT]
    found += forbidden_imports("ingest", NOT_IN_PRODUCT, dynamic=True)
    found += forbidden_imports("actors", NOT_IN_PRODUCT, dynamic=True)
    found += forbidden_imports("jax_side", NOT_IN_PRODUCT, dynamic=True)
    assert found == []


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# Underscore names that their library documents as public.
PUBLIC_UNDERSCORE = {"os._exit"}
PROJECT = {*LAYERS, *NOT_IN_PRODUCT}


def _import_bound(tree: ast.AST) -> dict[str, str]:
    """The names imports bind anywhere in ``tree``, each with the top-level package it
    names (a module or anything taken from one; ``""`` for a relative import)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {(a.asname or a.name).split(".")[0]: a.name.split(".")[0]
                      for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            top = "" if node.level else (node.module or "").split(".")[0]
            bound |= {a.asname or a.name: top for a in node.names}
    return bound


def private_uses(path: Path, root: Path = ROOT) -> list[tuple[str, str]]:
    """``from x import _y``, ``import x._y`` and ``x._y`` where ``x`` is a name an import
    bound (a module or anything taken from one): ``(top-level package of x, "line: use")``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    bound: dict[str, str] = {}  # a name an import binds -> the top-level package it names
    found = []
    for line, module, names in import_statements(path, root):
        top = module.split(".")[0]
        found += [(top, f"{line}: {module}") for part in module.split(".") if _private(part)]
        found += [(top, f"{line}: from {module} import {n}") for n in names if _private(n)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {(a.asname or a.name).split(".")[0]: a.name.split(".")[0]
                      for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            bound |= {a.asname or a.name: (node.module or ".").split(".")[0] for a in node.names}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr)
                and isinstance(node.value, ast.Name) and node.value.id in bound
                and f"{node.value.id}.{node.attr}" not in PUBLIC_UNDERSCORE):
            found.append((bound[node.value.id], f"{node.lineno}: {node.value.id}.{node.attr}"))
    return sorted(set(found))


def private_uses_outside_tests(*, project: bool) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{use}"
            for pkg in (*LAYERS, "benchmarks", "examples", "cluster")
            for path in sorted((ROOT / pkg).rglob("*.py"))
            for top, use in private_uses(path)
            if (top in PROJECT or top == "") is project]


def test_no_module_imports_another_modules_underscore_names_outside_tests():
    # Tests may reach into internals; the product, the benchmarks and the examples may not.
    assert private_uses_outside_tests(project=True) == []


# -- other libraries' private attributes, keywords and modules, on any object ----------------

# Underscore attributes of other libraries that are flagged on any object, even where the
# project happens to define the same name.
KNOWN_PRIVATE_ATTRIBUTES = {"_src", "_private", "_core_bpe", "_mergeable_ranks", "_pat_str",
                            "_special_tokens", "_cluster_types", "_global_node"}
# Underscore names that the standard library documents as public (os._exit, namedtuples,
# enums, sys._getframe).
PUBLIC_UNDERSCORE_ATTRIBUTES = {"_exit", "_asdict", "_replace", "_fields", "_make",
                                "_field_defaults", "_getframe", "_missing_",
                                "_generate_next_value_", "_name_", "_value_", "_ignore_"}
SCANNED = (*LAYERS, "benchmarks", "examples", "cluster")
_PROBES = {"getattr", "hasattr", "setattr", "delattr"}


def defined_private_names(paths) -> tuple[set[str], set[str]]:
    """The underscore names the project defines in ``paths`` (functions, classes, variables,
    attributes it assigns, parameters, import aliases, ``setattr`` and ``__slots__`` names),
    and, apart, its functions' underscore parameters."""
    names: set[str] = set()
    params: set[str] = set()
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
                params.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
            elif (isinstance(node, ast.Call) and _callee(node) in ("setattr", "__setattr__")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                names.add(str(node.args[1].value))
            elif (isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets)):
                names |= {c.value for c in ast.walk(node.value)
                          if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return ({n for n in names if _private(n)}, {n for n in params if _private(n)})


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _foreign_attribute(name: str, defined: set[str]) -> bool:
    """Whether ``name`` read off an object is another library's private attribute."""
    return _private(name) and (name in KNOWN_PRIVATE_ATTRIBUTES or (
        name not in defined and name not in PUBLIC_UNDERSCORE_ATTRIBUTES))


def _private_module_path(text: str) -> bool:
    """Whether ``text`` is a dotted module path of another library with a private part
    (``ray._private.worker``, ``jax._src``)."""
    parts = text.split(".")
    return (len(parts) > 1 and all(p.isidentifier() for p in parts)
            and parts[0] not in PROJECT and any(_private(p) for p in parts[1:]))


def foreign_private_uses(path: Path, defined: set[str], params: set[str]) -> list[str]:
    """``"line: use"`` for each use in ``path`` of another library's private attribute (on any
    object, also through ``getattr``), of an underscore keyword argument that no project
    function takes (``ray.init(_system_config=...)``, also as ``**{"_x": ...}`` or through a
    wrapper's ``**kwargs``), and of a private module named in a call."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    libraries = {name for name, top in _import_bound(tree).items() if top not in PROJECT}

    def add(node: ast.AST, what: str) -> None:
        found.append(f"{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            # On another library's module (jax.experimental._x): whatever the project defines.
            if ((isinstance(root, ast.Name) and root.id in libraries
                 and f"{root.id}.{node.attr}" not in PUBLIC_UNDERSCORE)
                    or _foreign_attribute(node.attr, defined)):
                add(node, ast.unparse(node))
        if not isinstance(node, ast.Call):
            continue
        callee = _callee(node)
        for k in node.keywords:
            keys = [k.arg] if k.arg else [c.value for c in getattr(k.value, "keys", [])
                                          if isinstance(c, ast.Constant)]
            for key in keys:
                if isinstance(key, str) and _private(key) and key not in params:
                    add(node, f"{callee}(..., {key}=...)")
        args = [a.value for a in node.args
                if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if (callee in _PROBES and len(node.args) > 1 and node.args[1] is not None
                and isinstance(node.args[1], ast.Constant)
                and _foreign_attribute(str(node.args[1].value), defined)):
            add(node, f"{callee}(..., {node.args[1].value!r})")
        found += [f"{node.lineno}: {callee}({a!r})" for a in args if _private_module_path(a)]
    return sorted(set(found), key=lambda u: (int(u.split(":")[0]), u))


def scanned_files() -> list[Path]:
    return [path for pkg in SCANNED for path in sorted((ROOT / pkg).rglob("*.py"))]


def foreign_private_uses_outside_adapters() -> dict[str, list[str]]:
    """``{file: uses}`` of other libraries' private APIs, in every scanned module but the
    adapters: private imports and bound names (``private_uses``) and the uses on any object
    (``foreign_private_uses``)."""
    files = scanned_files()
    defined, params = defined_private_names(files)
    out: dict[str, list[str]] = {}
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel in PRIVATE_API_ADAPTERS:
            continue
        uses = [use for top, use in private_uses(path) if top not in PROJECT and top != ""]
        uses += foreign_private_uses(path, defined, params)
        if uses:
            out[rel] = sorted(set(uses), key=lambda u: (int(u.split(":")[0]), u))
    return out


def test_private_apis_of_other_libraries_are_used_only_through_the_adapters():
    # jax_side.private_api (JAX's coordination client), actors.private_api (Ray's address
    # lookup, ray.init's underscore arguments), ingest.tokenize.private_api (tokenizer libraries) and
    # benchmarks.private_api (a raylet's gRPC channel) hold every such use, each with a
    # public fallback.
    found = foreign_private_uses_outside_adapters()
    assert found == {}, "\n".join(f"{f}:{u}" for f, uses in found.items() for u in uses)


def test_the_adapters_are_where_the_private_uses_are():
    # The scan must see the adapters' own uses, or it sees nothing.
    files = scanned_files()
    defined, params = defined_private_names(files)
    for rel in sorted(PRIVATE_API_ADAPTERS):
        path = ROOT / rel
        uses = [u for top, u in private_uses(path) if top not in PROJECT]
        uses += foreign_private_uses(path, defined, params)
        assert uses, f"{rel} uses no private API: the scan is broken, or the adapter is dead"


@pytest.mark.parametrize(("files", "cycle"), [
    ({"a.py": "import pkg.b\n", "b.py": "def f():\n    from pkg.a import x\n"}, True),
    ({"a.py": "from . import b\n", "b.py": "from .a import x\n"}, True),
    ({"a.py": "from . import b\n", "b.py": "x = 1\n"}, False),
    ({"a.py": "import pkg.b\n", "b.py": "import pkg.c\n", "c.py": "import pkg.a.x\n"}, True),
    ({"a.py": "import pkg.b\n", "b.py": "import pkg.c\n", "c.py": "import os\n"}, False),
])
def test_the_cycle_scan_sees_function_level_relative_and_longer_cycles(tmp_path, files, cycle):
    (tmp_path / "pkg").mkdir()
    for name, text in files.items():
        (tmp_path / "pkg" / name).write_text(text)
    assert bool(find_cycle(module_graph(["pkg"], tmp_path))) is cycle


@pytest.mark.parametrize(("source", "private"), [
    ("import jax\njax._src.lib.xla_client", True),
    ("import jax\njax.experimental._hidden", True),
    ("def f(encoding):\n    return encoding._mergeable_ranks", True),
    ("def f(tok):\n    return tok.enc._core_bpe.encode", True),
    ("class A:\n    def __init__(self):\n        self._enc = 1\n"
     "    def f(self, t):\n        return t._enc._pat_str", True),
    ("def f(x):\n    return x._some_attribute_nobody_defines", True),
    ("def f(enc):\n    return getattr(enc, '_core_bpe', None)", True),
    ("import ray\nray.init(address='local', _system_config={'a': 0})", True),
    ("import ray\ndef start(**kw):\n    ray.init(**kw)\nstart(_temp_dir='/tmp/x')", True),
    ("import ray\nray.init(**{'_temp_dir': '/tmp/x'})", True),
    ("import logging\nlogging.getLogger('ray._private.worker')", True),
    ("import importlib\nimportlib.import_module('jax._src.clusters')", True),
    ("import os\nos._exit(1)", False),
    ("class A:\n    def __init__(self):\n        self._y = 1\n    def f(self):\n"
     "        return self._y", False),
    ("def f(*, _seed=0):\n    return _seed\nf(_seed=1)", False),
    ("import ray\nray.init(address='local', num_cpus=2)", False),
    ("def f(x):\n    return x.__class__.__name__", False),
    ("import logging\nlogging.getLogger('ingest._internal')", False),
])
def test_the_foreign_private_scan_catches_a_planted_violation(tmp_path, source, private):
    path = tmp_path / "planted.py"
    path.write_text(source + "\n")
    defined, params = defined_private_names(scanned_files() + [path])
    assert bool(foreign_private_uses(path, defined, params)) is private, \
        foreign_private_uses(path, defined, params)


def test_a_violation_planted_in_a_product_module_fails_the_scan(tmp_path):
    """A copy of a real product module with one line of tiktoken's internals added."""
    original = ROOT / "jax_side" / "batch_assembly.py"
    path = tmp_path / "batch_assembly.py"
    path.write_text(original.read_text(encoding="utf-8")
                    + "\n\ndef ranks(encoding):\n    return encoding._mergeable_ranks\n")
    defined, params = defined_private_names(scanned_files())
    assert foreign_private_uses(original, defined, params) == []
    assert [u.split(": ", 1)[1] for u in foreign_private_uses(path, defined, params)] == [
        "encoding._mergeable_ranks"]


@pytest.mark.parametrize(("source", "private"), [
    ("from x import _y", True), ("import x._y", True), ("import x\nx._y()", True),
    ("from a import b\nb._c", True), ("import x\nx.__name__", False),
    ("from x import y\ny.z", False), ("class A:\n    def f(self):\n        self._y", False),
    ("import os\nos._exit(1)", False),
])
def test_the_private_scan_sees_every_form(tmp_path, source, private):
    path = tmp_path / "m.py"
    path.write_text(source + "\n")
    assert bool(private_uses(path, tmp_path)) is private
