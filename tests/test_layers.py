"""The layer contracts (import-linter, ``pyproject.toml``) hold, and would catch a breach."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.imports import import_cycles
from tests.procs import ROOT

LINT_IMPORTS = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=tree, capture_output=True, text=True, timeout=120,
                          env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(tree)})


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_config_importing_the_parameter_server_breaks_the_contracts(tmp_path):
    shutil.copytree(ROOT / "psserver", tmp_path / "psserver", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    ok = lint_imports(tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    with open(tmp_path / "psserver" / "config" / "ps.py", "a") as f:
        f.write("\nimport psserver.ps  # noqa: E402,F401\n")
    broken = lint_imports(tmp_path)
    assert broken.returncode != 0
    assert "config and models never import an implementation BROKEN" in broken.stdout, broken.stdout


@pytest.mark.timeout(120)
def test_no_import_cycles():
    """No module of psserver imports, through any chain, a module that imports it (lazy
    imports inside functions included: grimp reads them too)."""
    cycles = import_cycles("psserver")
    assert not cycles, "\n".join(cycles)
