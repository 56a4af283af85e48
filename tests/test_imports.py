"""Module rules: the capacity model stays pure; public names are exactly these."""

from __future__ import annotations

import ast
from pathlib import Path

import gateway

PKG = Path(gateway.__file__).parent
BANNED = {"asyncio", "anyio", "httpx", "starlette", "fastapi", "prometheus_client", "aiohttp",
          "socket", "os", "gateway.admission", "gateway.proxy", "gateway.app"}


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_capacity_has_no_io_or_async_imports() -> None:
    # The admission order (fairness) and the slot prefixes are pure too.
    for module in ("capacity.py", "errors.py", "fairness.py", "prefix.py"):
        found = {n for n in imported(PKG / module) if n in BANNED or n.split(".")[0] in BANNED}
        assert found == set(), (module, found)


def test_public_names() -> None:
    assert sorted(gateway.__all__) == ["Settings", "create_app", "load_settings"]


def test_no_app_created_at_import() -> None:
    import gateway.app as app_module

    assert not any(type(v).__name__ == "FastAPI" for v in vars(app_module).values())


def test_runtime_never_imports_the_offline_tooling() -> None:
    runtime = [p for p in PKG.rglob("*.py")
               if p.parent.name not in ("planner", "dev") and p.name != "__main__.py"]
    for path in runtime:
        found = {n for n in imported(path) if n.startswith(("gateway.planner", "gateway.dev"))}
        assert found == set(), (path.name, found)
