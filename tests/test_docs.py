"""The README and the pages under docs/ stay short where they should and true to the code: every
flag they name is one a verb takes (its ``--help`` lists it), and every page is linked."""

from __future__ import annotations

import re

import pytest

from psserver.cli import VERBS as COMMANDS
from tests.procs import ROOT, cli

DOCS = sorted((ROOT / "docs").glob("*.md"))
VERBS = [verb.name for verb in COMMANDS]
OTHER_TOOLS = {"--no-deps", "--batch", "--signal", "--nodes", "--check", "--master-addr"}
"""Flags the docs show of other programs (pip, scancel, torchrun, codegen's --check)."""


def flags_in(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", text))


@pytest.fixture(scope="module")
def cli_flags() -> set[str]:
    helps = [cli([verb, "--help"]).stdout for verb in VERBS]
    helps += [cli(["train", "--mode", mode, "--help"]).stdout for mode in ("ddp", "fsdp")]
    helps += [cli(["--help"]).stdout]
    return set().union(*(flags_in(h) for h in helps))


def test_the_readme_is_short_and_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in DOCS:
        assert f"(docs/{page.name})" in readme, f"the README does not link docs/{page.name}"


def benchmark_flags() -> set[str]:
    """The flags of the benchmarks' own command lines (``python -m benchmarks.X``)."""
    source = "\n".join(p.read_text() for p in (ROOT / "benchmarks").rglob("*.py"))
    return set(re.findall(r"add_argument\(\s*\"(--[a-z][a-z0-9-]+)\"", source))


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_every_flag_the_docs_name_is_one_a_verb_takes(page, cli_flags):
    known = cli_flags | OTHER_TOOLS | (benchmark_flags() if page.name == "benchmarks.md" else set())
    unknown = flags_in(page.read_text()) - known
    assert not unknown, f"{page.relative_to(ROOT)} names flags no psserver verb takes: {sorted(unknown)}"


def test_every_environment_variable_psserver_reads_is_documented():
    source = "\n".join(p.read_text() for p in (ROOT / "psserver").rglob("*.py"))
    read = set(re.findall(r"[\"'](PSSERVER_[A-Z_]+)[\"']", source))
    documented = (ROOT / "docs" / "configuration.md").read_text()
    missing = sorted(v for v in read if f"`{v}`" not in documented)
    assert not missing, f"docs/configuration.md does not document {missing}"
