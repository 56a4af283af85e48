"""Module rules: the layers of ``gateway/`` import only downward, the pure layers do no I/O,
and the public names are exactly these.

The layers, bottom to top (``../shared/design/review-2026-12.md``, section 4). A module may
import from its own layer and from any layer below it, never from one above:

    errors, clock -> core, wire -> config -> admission -> backends -> observe -> fleet
    -> request -> relay -> http

``core`` is below ``wire``: the formats may use the model, the model never sees a format.
``planner/`` and ``dev/`` are offline tooling beside the runtime: they may import it, it never
imports them. ``gateway/__init__.py`` and ``__main__.py`` sit on top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gateway

PKG = Path(gateway.__file__).parent

#: Layer of each top-level part of the package (a subpackage or a module), bottom first.
LAYERS: dict[str, int] = {
    "errors": 0, "clock": 0, "tasks": 0,
    "core": 1,
    "wire": 2,
    "config": 3,
    "admission": 4,
    "backends": 5,
    "observe": 6,
    "fleet": 7,
    "request": 8,
    "relay": 9,
    "http": 10,
    "__init__": 11, "__main__": 11,
}
OFFLINE = {"planner", "dev"}

#: Imports that break the order today, each to be removed by the step of issue 24 that
#: fixes it. The test fails on any other upward import, and on an entry here that no
#: longer exists, so this list can only shrink.
KNOWN_UPWARD: set[tuple[str, str]] = set()

#: No I/O, no event loop, no framework in the pure layers.
IO_BANNED = {"asyncio", "anyio", "httpx", "starlette", "fastapi", "prometheus_client",
             "aiohttp", "socket", "os", "uvicorn"}
PURE = ("core", "wire", "errors")


def imported(path: Path) -> set[str]:
    """Every module name ``path`` imports, at any depth of its code (deferred imports too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:
                raise AssertionError(f"{path}: relative import of {node.module}")
            names.add(node.module)
            if node.module == "gateway":
                names |= {f"gateway.{a.name}" for a in node.names}
    return names


def part_of(module: str) -> str | None:
    """The top-level part of ``gateway`` a dotted module name belongs to (None outside)."""
    bits = module.split(".")
    if bits[0] != "gateway" or len(bits) < 2:
        return None
    return bits[1]


def runtime_files() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py")
                  if p.relative_to(PKG).parts[0] not in OFFLINE)


def upward_imports(files: list[Path], root: Path = PKG) -> set[tuple[str, str]]:
    """(importing part, imported part) for each import in ``files`` (under ``root``, the
    package folder) that climbs the layers."""
    found: set[tuple[str, str]] = set()
    for path in files:
        own = path.relative_to(root).parts[0].removesuffix(".py")
        for name in imported(path):
            other = part_of(name)
            if other is None or other == own or other in OFFLINE:
                continue
            if LAYERS[other] > LAYERS[own]:
                found.add((f"{own}", f"{other}"))
    return found


def test_every_part_has_a_layer() -> None:
    parts = {p.relative_to(PKG).parts[0].removesuffix(".py") for p in runtime_files()}
    assert parts - set(LAYERS) == set(), "give each new part of gateway/ a layer"


def test_no_import_climbs_the_layers() -> None:
    found = upward_imports(runtime_files())
    assert found - KNOWN_UPWARD == set(), "an import goes up the layers"
    assert KNOWN_UPWARD - found == set(), "an exception is gone: remove it from KNOWN_UPWARD"


def test_the_layer_test_catches_an_upward_import(tmp_path: Path) -> None:
    # The real capacity module plus one deliberate upward import (deferred, inside a
    # function, where it is easiest to hide) is caught; without it, the copy is clean.
    real = (PKG / "core" / "capacity.py").read_text()
    (tmp_path / "core").mkdir()
    copy = tmp_path / "core" / "capacity.py"
    copy.write_text(real)
    assert upward_imports([copy], root=tmp_path) == set()
    copy.write_text(real + "\n\ndef _late():\n    from gateway.relay.response import ProxyResponse\n")
    assert upward_imports([copy], root=tmp_path) == {("core", "relay")}


@pytest.mark.parametrize("part", PURE)
def test_pure_layers_have_no_io_or_async_imports(part: str) -> None:
    paths = [PKG / f"{part}.py"] if (PKG / f"{part}.py").exists() else \
        sorted((PKG / part).rglob("*.py"))
    assert paths
    for path in paths:
        found = {n for n in imported(path) if n.split(".")[0] in IO_BANNED}
        assert found == set(), (path.name, found)


def test_public_names() -> None:
    assert sorted(gateway.__all__) == ["Settings", "create_app", "load_settings"]


def test_no_app_created_at_import() -> None:
    import gateway.http.app as app_module

    assert not any(type(v).__name__ == "FastAPI" for v in vars(app_module).values())


def test_runtime_never_imports_the_offline_tooling() -> None:
    runtime = [p for p in runtime_files() if p.name != "__main__.py"]
    for path in runtime:
        found = {n for n in imported(path) if n.startswith(("gateway.planner", "gateway.dev"))}
        assert found == set(), (path.name, found)
