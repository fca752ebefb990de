"""``MODULE:ATTR`` references and ``--*-args JSON``: every failure one line naming its part."""

from __future__ import annotations

import os
import sys

import pytest

from psserver.errors import UsageError, UserCodeError
from psserver.utils.references import call_user, load_reference, parse_json_args


def exits_recorded(code: int) -> None:
    raise AssertionError(f"os._exit({code}) reached the process")


@pytest.fixture
def userpkg(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "_exit", exits_recorded)  # one that escapes fails, not ends, the test process
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "things.py").write_text(
        "import math\n"
        "class Holder:\n    class Inner:\n        pass\n"
        "def scale(x, *, factor=2):\n    return x * factor\n"
        "def broken():\n    return 1 / 0\n"
        "def quits():\n    sys.exit(0)\n"
        "import sys\n")
    (pkg / "needs_dep.py").write_text("import not_installed_anywhere\n")
    (pkg / "raises.py").write_text("raise RuntimeError('configuration missing')\n")
    (pkg / "exits.py").write_text("import sys\nsys.exit(0)\n")
    (pkg / "base_raises.py").write_text("class Boom(BaseException):\n    pass\nraise Boom('no config')\n")
    (pkg / "hard_exits.py").write_text("import os\ntry:\n    os._exit(0)\nexcept Exception:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    for name in [m for m in sys.modules if m == "userpkg" or m.startswith("userpkg.")]:
        del sys.modules[name]


def test_loads_module_attributes_and_nested_ones(userpkg):
    assert load_reference("userpkg.things:scale", "--model")(3) == 6
    assert load_reference("userpkg.things:Holder.Inner", "--model").__name__ == "Inner"


@pytest.mark.parametrize(("reference", "match"), [
    ("userpkg.things", r"is not MODULE:ATTR"),
    ("userpkg.things:", r"is not MODULE:ATTR"),
    ("userpkg/things.py:scale", r"is not MODULE:ATTR"),
    ("nopkg.models:Net", r"module 'nopkg.models' is not importable \(no module named 'nopkg'"),
    ("userpkg.nothere:Net", r"module 'userpkg.nothere' is not importable"),
    ("userpkg.needs_dep:Net", r"importing module 'userpkg.needs_dep' failed: ModuleNotFoundError: "
                              r"No module named 'not_installed_anywhere'"),
    ("userpkg.raises:Net", r"importing module 'userpkg.raises' failed: RuntimeError: configuration missing"),
    ("userpkg.exits:Net", r"importing module 'userpkg.exits' failed: SystemExit: 0"),  # not psserver's exit
    ("userpkg.base_raises:Net", r"importing module 'userpkg.base_raises' failed: Boom: no config"),
    ("userpkg.hard_exits:Net", r"importing module 'userpkg.hard_exits' failed: called os._exit\(0\)"),
    ("userpkg.things:Nope", r"'userpkg.things' has no attribute 'Nope'"),
    ("userpkg.things:Holder.Nope", r"'userpkg.things:Holder' has no attribute 'Nope'"),
])
def test_bad_references_say_which_part_failed(userpkg, reference, match):
    with pytest.raises(UserCodeError, match=match) as info:
        load_reference(reference, "--model")
    assert isinstance(info.value, UsageError) and "\n" not in str(info.value)
    assert str(info.value).startswith("--model ")


def test_json_args():
    assert parse_json_args(None, "--model-args") == {}
    assert parse_json_args("  ", "--model-args") == {}
    assert parse_json_args('{"width": 64, "act": "relu", "dims": [1, 2]}', "--model-args") == {
        "width": 64, "act": "relu", "dims": [1, 2]}


@pytest.mark.parametrize(("text", "match"), [
    ("{width: 64}", r"--model-args is not JSON \(Expecting property name"),
    ('{"a": 1', r"is not JSON"),
    ("[1, 2]", r"must be a JSON object of keyword arguments.*got list"),
    ('"x"', r"got str"),
    ('{"lr": NaN}', r"NaN is not a value"),
    ('{"lr": -Infinity}', r"-Infinity is not a value"),
    ('{"lr": 1e999}', r"infinity"),
    ("[" * 100_000, r"nested too deeply"),
])
def test_bad_json_args(text, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_json_args(text, "--model-args")
    assert "\n" not in str(info.value)


def test_call_user_checks_arguments_and_reports_failures_in_one_line(userpkg):
    from userpkg.things import broken, quits, scale

    assert call_user(scale, (2,), {"factor": 5}, "--model m") == 10
    with pytest.raises(UserCodeError, match=r"--model m does not accept these arguments: got an unexpected "
                                            r"keyword argument 'width' \(its signature: \(x, \*, factor=2\)\)"):
        call_user(scale, (2,), {"width": 5}, "--model m")
    with pytest.raises(UserCodeError, match=r"--model m raised ZeroDivisionError: division by zero "
                                            r"\(at .*things.py:8\)"):
        call_user(broken, (), {}, "--model m")
    with pytest.raises(UserCodeError, match=r"--model m raised SystemExit: 0"):
        call_user(quits, (), {}, "--model m")
