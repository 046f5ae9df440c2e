"""Every third-party import of the repository is declared in pyproject.toml, in the right place.

Product imports (``ingest``, ``actors``, ``jax_side``) belong in ``dependencies``; imports of
the tests and examples in ``dependencies`` or the ``test`` extra (the tests import the
benchmarks too); imports of the benchmarks in ``dependencies`` or the ``bench`` extra.
Optional imports (inside ``try: ... except ImportError`` or ``pytest.importorskip``) may sit in
any extra.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRODUCT = ("ingest", "actors", "jax_side")
SCANNED = (*PRODUCT, "tests", "benchmarks", "examples")
# Where each folder's required imports must be declared, besides `dependencies`.
EXTRAS_FOR = {"ingest": (), "actors": (), "jax_side": (), "tests": ("test", "eval-test"),
              "benchmarks": ("bench",), "examples": ("test",)}
# The tests run the benchmarks' functions (tests/test_bench.py) and the example.
ALSO_NEEDED_BY = {"benchmarks": ("tests",), "examples": ("tests",)}

_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement(spec: str) -> tuple[str, set[str]]:
    """(normalized distribution name, extras) of a requirement string."""
    m = _NAME.match(spec)
    assert m, f"unparsable requirement {spec!r} in pyproject.toml"
    extras = {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}
    return _normalize(m.group(1)), extras


def _declared() -> dict[str, dict[str, set[str]]]:
    """{'dependencies' or an extra's name: {distribution: its extras}}."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    out: dict[str, dict[str, set[str]]] = {}
    for group, specs in groups.items():
        for spec in specs:
            name, extras = _requirement(spec)
            out.setdefault(group, {}).setdefault(name, set()).update(extras)
    return out


def _local_modules() -> set[str]:
    """Top-level names that resolve to the repository itself (packages, test helpers)."""
    names = set(SCANNED) | {"cluster"}
    for folder in SCANNED:
        names.update(p.stem for p in (ROOT / folder).glob("*.py"))
    return names


def _optional_lines(tree: ast.AST) -> set[int]:
    """Line numbers of imports guarded by ``except ImportError`` (or ModuleNotFoundError)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        caught = set()
        for h in node.handlers:
            types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
            caught.update(t.id for t in types if isinstance(t, ast.Name))
        if caught & {"ImportError", "ModuleNotFoundError", "Exception"}:
            for stmt in node.body:
                lines.update(n.lineno for n in ast.walk(stmt) if hasattr(n, "lineno"))
    return lines


def _imports(path: pathlib.Path) -> tuple[set[str], set[str], bool]:
    """(required, optional) top-level imported names of a file, and whether it uses
    ``ray.data``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    optional_lines = _optional_lines(tree)
    required: set[str] = set()
    optional: set[str] = set()
    uses_ray_data = False
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "importorskip" and node.args
              and isinstance(node.args[0], ast.Constant)):
            optional.add(node.args[0].value.split(".")[0])
        elif (isinstance(node, ast.Attribute) and node.attr == "data"
              and isinstance(node.value, ast.Name) and node.value.id == "ray"):
            uses_ray_data = True
        for name in names:
            if name == "ray.data" or name.startswith("ray.data."):
                uses_ray_data = True
            (optional if node.lineno in optional_lines else required).add(name.split(".")[0])
    return required, optional, uses_ray_data


def _scan() -> dict[str, dict[str, set[str]]]:
    """Per scanned folder: {'required'/'optional': top-level names, 'ray_data': {...}}."""
    local = _local_modules()
    out = {}
    for folder in SCANNED:
        req: set[str] = set()
        opt: set[str] = set()
        ray_data: set[str] = set()
        for path in sorted((ROOT / folder).rglob("*.py")):
            r, o, rd = _imports(path)
            req |= r
            opt |= o
            if rd:
                ray_data.add(str(path.relative_to(ROOT)))
        third = {n for n in req | opt if n not in sys.stdlib_module_names and n not in local}
        out[folder] = {"required": third & req, "optional": (third & opt) - req,
                       "ray_data": ray_data}
    return out


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    """Top-level module -> its distributions: a scan of every installed package's files,
    which takes about half a second, so done once."""
    return importlib.metadata.packages_distributions()


def _distributions(module: str) -> set[str]:
    """The normalized distributions that provide a top-level module (its own name when it is
    not installed here)."""
    found = _packages_distributions().get(module)
    return {_normalize(d) for d in found} if found else {_normalize(module)}


def test_every_import_is_declared_where_it_is_needed():
    declared = _declared()
    scan = _scan()
    problems = []
    for folder, found in scan.items():
        needers = (folder, *ALSO_NEEDED_BY.get(folder, ()))
        for module in sorted(found["required"]):
            dists = _distributions(module)
            for who in needers:
                places = ("dependencies", *EXTRAS_FOR[who])
                if not any(dists & set(declared.get(g, {})) for g in places):
                    problems.append(f"{folder}/ imports {module!r} (distribution "
                                    f"{sorted(dists)}), which {who}/ needs: declare it in "
                                    f"{' or '.join(places)}")
        for module in sorted(found["optional"]):
            dists = _distributions(module)
            if not any(dists & set(names) for names in declared.values()):
                problems.append(f"{folder}/ optionally imports {module!r}: declare "
                                f"{sorted(dists)} in an extra")
        if found["ray_data"]:
            for who in needers:
                places = ("dependencies", *EXTRAS_FOR[who])
                if not any("data" in declared.get(g, {}).get("ray", set()) for g in places):
                    problems.append(f"{sorted(found['ray_data'])} use Ray Data, which "
                                    f"{who}/ needs: declare ray[data] in {' or '.join(places)}")
    assert not problems, "\n".join(problems)


def test_the_scan_sees_the_imports_it_must_check():
    """A guard against a scan that silently finds nothing: imports known to be there."""
    scan = _scan()
    assert {"numpy", "pyarrow", "yaml", "tiktoken", "tokenizers"} <= scan["ingest"]["required"]
    assert {"ray"} <= scan["actors"]["required"]
    assert {"jax", "orbax", "etils", "grain"} <= scan["jax_side"]["required"]
    assert {"pytest", "hypothesis"} <= scan["tests"]["required"]
    assert "psutil" in scan["benchmarks"]["required"]
    assert "matplotlib" in scan["benchmarks"]["optional"]
    assert scan["benchmarks"]["ray_data"]
    assert not ({"ingest", "actors", "jax_side", "helpers"} & scan["tests"]["required"])
    assert _distributions("yaml") == {"pyyaml"}


def test_runtime_dependencies_are_ranges_and_keep_the_installed_jax():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = [s for s in project["dependencies"] if "==" in s.split(";")[0]]  # not markers
    assert not pinned, f"exact pins in dependencies: {pinned}; give compatible ranges"
    jax = [s for s in project["dependencies"] if _requirement(s)[0] == "jax"]
    assert jax and not _requirement(jax[0])[1], (
        f"{jax}: jax must come without an accelerator extra, so that a GPU/TPU jax is kept")
    assert any(_requirement(s) == ("jax", {"cpu"})
               for s in project["optional-dependencies"]["cpu"])



# The packages `make test-floor` installs at their floors (.ci/floor-constraints.txt).
FLOORED = ("numpy", "pyarrow", "ray", "jax", "grain", "orbax-checkpoint", "tokenizers")


def _constraints() -> dict[str, str]:
    """{normalized name: pinned version} of .ci/floor-constraints.txt."""
    pins = {}
    for line in (ROOT / ".ci" / "floor-constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"floor-constraints.txt: {line!r} is not NAME==VERSION"
            pins[_normalize(name)] = version.strip()
    return pins


def test_floors_equal_the_pins_of_the_floor_environment_and_jax_stops_before_its_next_release():
    """pyproject's floors are what `make test-floor` installs, so a floor cannot move without
    being tested; jax has an upper bound at its first untested release in every group."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    pins = _constraints()
    problems = []
    deps = {_normalize(Requirement(s).name): Requirement(s) for s in project["dependencies"]}
    for name in FLOORED:
        floors = [s.version for s in deps[name].specifier if s.operator == ">="]
        if name not in pins:
            problems.append(f"{name} has no pin in .ci/floor-constraints.txt")
        elif len(floors) != 1 or Version(floors[0]) != Version(pins[name]):
            problems.append(f"pyproject's {deps[name]} has not the floor {pins[name]} that "
                            f".ci/floor-constraints.txt tests: make them equal")
    if pins.get("jaxlib") != pins.get("jax"):
        problems.append(f"floor-constraints.txt pins jaxlib {pins.get('jaxlib')} beside jax "
                        f"{pins.get('jax')}: pin both to the same release")
    # Every other mention of a floored package (ray[data], jax[cpu], jax[k8s]) has its range;
    # the bench extra may only ask for more (its peers need newer releases).
    for group, specs in groups.items():
        for s in specs:
            req = Requirement(s)
            name = _normalize(req.name)
            if name not in FLOORED or group == "dependencies":
                continue
            if group == "bench":
                floor = [x.version for x in req.specifier if x.operator == ">="]
                if not floor or Version(floor[0]) < Version(pins.get(name, "0")):
                    problems.append(f"bench's {s} is below the floor {pins.get(name)}")
            elif req.specifier != deps[name].specifier:
                problems.append(f"{group}'s {s} differs from dependencies' {deps[name]}")
    uppers = [Version(s.version) for s in deps["jax"].specifier if s.operator == "<"]
    installed = Version(importlib.metadata.version("jax"))
    if not uppers:
        problems.append("jax has no upper bound: a fresh install could take an untested jax")
    elif installed not in deps["jax"].specifier:
        problems.append(f"jax {installed}, the one these tests run on, is outside {deps['jax']}")
    assert not problems, "\n".join(problems)
