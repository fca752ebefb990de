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
def test_an_import_across_the_roles_breaks_the_contracts(tmp_path):
    shutil.copytree(ROOT / "psserver", tmp_path / "psserver", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    ok = lint_imports(tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    breaches = {  # file -> the import it gets, the contract that must then fail
        "config/ps.py": ("psserver.server", "config and models never import an implementation"),
        "trainer/steps/chained.py": ("psserver.server.steps.chained", "a trainer process never loads server code"),
        "common/partition.py": ("psserver.trainer.compute.rows", "what both sides speak imports neither side"),
    }
    for path, (module, _) in breaches.items():
        with open(tmp_path / "psserver" / path, "a") as f:
            f.write(f"\nimport {module}  # noqa: E402,F401\n")
    broken = lint_imports(tmp_path)
    assert broken.returncode != 0
    text = " ".join(broken.stdout.split())  # contract names wrap in the report
    for _, contract in breaches.values():
        assert f"{contract}" in text and text.count("BROKEN") >= len(breaches), broken.stdout


def test_a_trainer_process_loads_no_server_module_and_the_reverse():
    """What the contracts say, at run time: the library, ``psserver train``'s loop and every
    trainer half load no ``psserver.server`` module; the server process and every server half
    load no ``psserver.trainer`` module."""
    code = (
        "import sys, importlib\n"
        "for m in sys.argv[2:]: importlib.import_module(m)\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith(sys.argv[1]))))\n")
    sides = {
        "psserver.server": ["psserver", "psserver.trainer.loop", "psserver.trainer.entry", "psserver.trainer.steps"],
        "psserver.trainer": ["psserver.server.server", "psserver.server.steps", "psserver.server.checkpoints.export"],
    }
    for other, modules in sides.items():
        out = subprocess.run([sys.executable, "-c", code, other, *modules], cwd=ROOT, capture_output=True,
                             text=True, timeout=120, check=True).stdout.split()
        assert out == [], f"{modules} loaded {out}"


@pytest.mark.timeout(120)
def test_no_import_cycles():
    """No module of psserver imports, through any chain, a module that imports it (lazy
    imports inside functions included: grimp reads them too)."""
    cycles = import_cycles("psserver")
    assert not cycles, "\n".join(cycles)
