from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def result_pattern(tmp_path: Path) -> Path:
    """Where ``--result-file`` writes each rank's JSON summary."""
    return tmp_path / "result-{rank}.json"
