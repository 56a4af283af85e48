"""The type checker over the gateway's code (issue 39): mypy, configured in
pyproject.toml's ``[tool.mypy]`` (the pydantic plugin for the settings), finds no error.
It checks what nothing else did: that each backend kind satisfies the ``Dialect``
protocol (its first run found the kinds' ``route_paths`` and ``default_caps`` declared
as mutable dicts where the protocol reads mappings), that every ``Racer`` a relay step
is given has the watcher's ``race``, and every Optional narrowed before use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
def test_mypy_finds_no_error_in_the_gateway(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT, capture_output=True, text=True, timeout=580, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Success: no issues found" in done.stdout
