"""Modes are chosen once (issue 39): outside the shared state's own modules, a line that
asks "is state shared?" (a condition on a name ``shared`` or ``store``: ``if shared``,
``store is None``, ``x if self.shared is not None else y``) is counted here, by file,
and may only get rarer (none is left). The admission asks its grantor
(:mod:`gateway.admission.grantor`), its live accounting its peers
(:class:`gateway.admission.live.Peers`), a pool's queue its
:class:`~gateway.fleet.pool.PoolGrantor`, and the rest the app's
:class:`~gateway.admission.state.StateStore`, chosen once in ``http/app.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[1] / "gateway"

#: The shared state's own modules: the seam's Redis side, free to know it is shared.
SEAM = re.compile(r"^admission/(shared[^/]*|pump)\.py$")
NAMES = re.compile(r"^_?(shared|store)$")

#: The most questions each file may still ask. Before the grantor (2026-12-07):
#: admission/admission.py 11, admission/live.py 6, backends/target.py 1, fleet/fleet.py
#: 2, fleet/routers.py 1, http/app.py 4, http/endpoints.py 1, http/status.py 1. The
#: tenant gate's 3 went with its Quota (admission/tenants.py); the last 11 with the
#: StateStore and the pool's grantor.
CEILING: dict[str, int] = {}

#: Where ``[state] backend`` is read: the one choice (``http/app.py``), and the command
#: line's refusal of ``--workers`` over memory state (``__main__.py``).
CHOOSERS = {"http/app.py": 1, "__main__.py": 1}


def _asks(test: ast.expr) -> bool:
    """``test`` is, or compares to ``None``, a name or attribute called shared/store."""
    if isinstance(test, ast.Name | ast.Attribute):
        return bool(NAMES.match(test.id if isinstance(test, ast.Name) else test.attr))
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value is None for c in node.comparators):
            left = node.left
            if isinstance(left, ast.Name | ast.Attribute) and NAMES.match(
                    left.id if isinstance(left, ast.Name) else left.attr):
                return True
        if isinstance(node, ast.UnaryOp) and _asks(node.operand):
            return True
        if isinstance(node, ast.BoolOp) and any(_asks(v) for v in node.values):
            return True
    return False


def questions(source: str) -> list[int]:
    """The line of each condition in ``source`` that asks whether state is shared."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If | ast.IfExp | ast.While | ast.Assert) and _asks(node.test):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_counter_sees_each_form_of_the_question() -> None:
    source = (
        "if shared is None:\n    pass\n"
        "x = 1 if self._shared is not None else 2\n"
        "while not store:\n    pass\n"
        "if a and self.shared:\n    pass\n"
        "if sharedness is None or shared_ids:\n    pass\n"  # other names: not asked
    )
    assert questions(source) == [1, 3, 4, 6]


def test_no_file_asks_more_often_whether_state_is_shared() -> None:
    found = {}
    for path in sorted(GATEWAY.rglob("*.py")):
        where = path.relative_to(GATEWAY).as_posix()
        if SEAM.match(where):
            continue
        lines = questions(path.read_text())
        if len(lines) > CEILING.get(where, 0):
            found[where] = lines
    assert found == {}, ("these files ask whether state is shared more often than "
                         f"CEILING allows (give the choice to a grantor or peers): {found}")


def test_the_state_store_is_chosen_in_one_place() -> None:
    found = {}
    for path in sorted(GATEWAY.rglob("*.py")):
        where = path.relative_to(GATEWAY).as_posix()
        if where == "config.py":
            continue
        reads = len(re.findall(r"StateBackend\.\w+", path.read_text()))
        if reads > CHOOSERS.get(where, 0):
            found[where] = reads
    assert found == {}, f"[state] backend is read outside the one choice: {found}"


#: Router mode is the fleet's (issue 39): only these modules import the router's code
#: (gateway.backends.router, router_gate) at run time (the offline planner aside), and
#: only these ask a target's router role what it is (``x.router.hub``, ``.parent``,
#: ``.model_id``), at most this often. Before (2026-12-07): backends/target.py imported
#: the router (its discovery raised RouterMode for it) and asked 2 times, http/ 15 times
#: (endpoints.py 6, side.py 4, views.py 5).
ROUTER_IMPORTERS = {"backends/router.py", "backends/router_gate.py", "fleet/routers.py"}
ROLE_CEILING = {"backends/target.py": 1}
ROLE = re.compile(r"\.router\.(hub|parent|model_id)\b")


def _runtime_imports(source: str) -> set[str]:
    """The modules ``source`` imports outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(source)
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                   for child in node.body for n in ast.walk(child)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_the_import_reader_skips_type_checking_blocks() -> None:
    source = ("from typing import TYPE_CHECKING\nimport a.b\n"
              "if TYPE_CHECKING:\n    from c import d\n")
    assert _runtime_imports(source) == {"typing", "a.b"}


def test_only_the_fleet_knows_router_mode() -> None:
    importers, askers = {}, {}
    for path in sorted(GATEWAY.rglob("*.py")):
        where = path.relative_to(GATEWAY).as_posix()
        if where.split("/")[0] in ("planner", "dev"):
            continue
        source = path.read_text()
        if where not in ROUTER_IMPORTERS and any(
                m.startswith("gateway.backends.router") for m in _runtime_imports(source)):
            importers[where] = sorted(m for m in _runtime_imports(source)
                                      if m.startswith("gateway.backends.router"))
        code = "\n".join(line for line in source.splitlines()
                         if not line.lstrip().startswith(("#", "*", ":", "``")))
        asked = len(ROLE.findall(code))
        if not where.startswith(("fleet/", "backends/router")) and asked > ROLE_CEILING.get(
                where, 0):
            askers[where] = asked
    assert importers == {}, f"router code imported outside the fleet: {importers}"
    assert askers == {}, f"a target's router role asked outside the fleet: {askers}"
