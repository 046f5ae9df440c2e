"""The layering rule: `ingest` imports neither `actors` nor `jax_side` (nor Ray
nor JAX); `actors` never imports `jax`."""

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
    code = ("import ingest, ingest.config, ingest.plan, ingest.stream, ingest.tokenize, sys; "
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(NOT_IN_INGEST)}); "
            "assert not bad, bad")
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
