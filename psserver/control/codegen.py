"""Regenerate (or ``--check``) the committed gRPC stubs of ``protos/psserver/v1/*.proto``.

The stubs are committed so that installing psserver needs no protoc; this script keeps them
honest. protoc writes ``from psserver.v1 import ...`` (the proto package path); the stubs live
in ``psserver.control.v1``, so the imports and the module names are rewritten. The output
depends on the grpcio-tools version (it embeds the protobuf/grpcio versions it was made
with), which is why the ``test`` extra pins grpcio-tools exactly.

    python -m psserver.control.codegen           # rewrite psserver/control/v1/control_pb2*.py*
    python -m psserver.control.codegen --check   # exit 1 and name the file that differs
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "protos"
PROTOS = ["psserver/v1/control.proto"]
PROTO_PACKAGE = "psserver.v1"
PY_PACKAGE = "psserver.control.v1"
OUT_DIR = REPO / "psserver" / "control" / "v1"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _fix(text: str) -> str:
    """Point the generated imports and module names at ``psserver.control.v1``."""
    pkg = re.escape(PROTO_PACKAGE)
    text = re.sub(rf"^from {pkg} import ", f"from {PY_PACKAGE} import ", text, flags=re.M)
    text = re.sub(rf"^import {pkg}\.", f"import {PY_PACKAGE}.", text, flags=re.M)
    # Module name given to the message classes (their __module__, used by pickle).
    text = re.sub(rf"'{pkg}\.(\w+_pb2)'", rf"'{PY_PACKAGE}.\1'", text)
    return text


def generate() -> dict[str, str]:
    """Run protoc (from grpcio-tools) and return {file name: fixed text}."""
    try:
        from importlib.resources import files

        from grpc_tools import protoc
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit(f"codegen needs grpcio-tools (pip install -e '.[test]'): {e}") from e
    if not PROTO_ROOT.is_dir():
        raise SystemExit(f"no protos at {PROTO_ROOT}: run from a source checkout")
    include = str(files("grpc_tools") / "_proto")
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(PROTO_ROOT / p) for p in PROTOS],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed (see the message above)")
        for proto in PROTOS:
            stem = Path(proto).with_suffix("")
            for suffix in SUFFIXES:
                generated = Path(tmp) / f"{stem}{suffix}"
                out[generated.name] = _fix(generated.read_text())
    return out


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m psserver.control.codegen", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on any difference")
    args = parser.parse_args(argv)
    wanted = generate()
    if args.check:
        differ = [
            _display(OUT_DIR / name)
            for name, text in sorted(wanted.items())
            if not (OUT_DIR / name).is_file() or (OUT_DIR / name).read_text() != text
        ]
        if differ:
            print(
                f"generated stubs out of date: {', '.join(differ)} differ from "
                f"{', '.join('protos/' + p for p in PROTOS)} (run: python -m psserver.control.codegen)",
                file=sys.stderr,
            )
            return 1
        return 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name, text in sorted(wanted.items()):
        path = OUT_DIR / name
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {_display(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
