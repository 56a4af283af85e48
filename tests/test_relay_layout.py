"""The relay's shape (gateway/relay): its modules share no private names, and no class
or function in it grows past the sizes the layering issue set."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RELAY = Path(__file__).resolve().parent.parent / "gateway" / "relay"
MAX_CLASS_LINES, MAX_CLASS_STATEMENTS, MAX_FUNCTION_LINES = 300, 200, 60


def private_uses(source: str) -> list[str]:
    """Private names (a leading underscore, not dunder) a module takes from elsewhere:
    imported, or read as an attribute of anything but ``self`` or ``cls``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found += [a.name for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append(node.attr)
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def oversized(source: str) -> list[str]:
    """Classes over the line or statement bound, functions over the line bound."""
    found = []
    for node in ast.walk(ast.parse(source)):
        lines = (node.end_lineno or node.lineno) - node.lineno + 1 \
            if isinstance(node, ast.stmt) else 0
        if isinstance(node, ast.ClassDef):
            statements = sum(isinstance(s, ast.stmt) for s in ast.walk(node)) - 1
            if lines > MAX_CLASS_LINES or statements > MAX_CLASS_STATEMENTS:
                found.append(f"class {node.name}: {lines} lines, {statements} statements")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) \
                and lines > MAX_FUNCTION_LINES:
            found.append(f"function {node.name}: {lines} lines")
    return found


MODULES = sorted(RELAY.glob("*.py"))


@pytest.mark.parametrize("module", MODULES, ids=[m.name for m in MODULES])
def test_no_private_name_crosses_a_relay_module(module: Path) -> None:
    assert private_uses(module.read_text()) == []


@pytest.mark.parametrize("module", MODULES, ids=[m.name for m in MODULES])
def test_no_relay_class_or_function_is_oversized(module: Path) -> None:
    assert oversized(module.read_text()) == []


def test_the_checks_catch_what_they_forbid() -> None:
    # Each check on a module written to break it: they can fail.
    assert private_uses("from gateway.relay.send import _PASS\nowner._send_error(1)\n"
                        "self._fine()\n") == ["_PASS", "_send_error"]
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_CLASS_STATEMENTS + 1))
    assert oversized(f"class Big:\n{body}") == [
        f"class Big: {MAX_CLASS_STATEMENTS + 2} lines, {MAX_CLASS_STATEMENTS + 1} statements"]
    long_fn = "def long():\n" + "    pass\n" * MAX_FUNCTION_LINES
    assert oversized(long_fn) == [f"function long: {MAX_FUNCTION_LINES + 1} lines"]


def test_the_response_holds_its_strategy_rather_than_being_subclassed() -> None:
    # Tracked behaviour is a strategy the response holds (composition), not a subclass.
    for module in MODULES:
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                assert "ProxyResponse" not in bases, (module.name, node.name)
