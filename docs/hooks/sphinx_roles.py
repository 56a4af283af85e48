"""A griffe extension that turns the docstrings' Sphinx roles into links in the API pages.

The package's docstrings cross-reference with Sphinx roles (``:class:`Lease```,
``:meth:`~gateway.backends.target.Target.stats```). mkdocstrings' ``sphinx`` docstring
style parses their ``:param:``/``:raises:`` fields but leaves inline roles as text, so the
page would read ``:class:Lease``. This extension rewrites each role, before rendering, as
an *optional* mkdocs-autorefs reference: a link when the object is documented, plain code
otherwise (an optional reference never fails the strict build). The files under
``gateway/`` are not changed.

A role's target is resolved as Sphinx does: a dotted path as written, else a name of the
object's own class or module (``:meth:`release``` inside ``Admission``). ``~`` shows only
the last part of the path.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(class|func|meth|mod|data|attr|exc|obj|const):`(~?)([\w.]+)(\(\))?`")


def _candidates(obj: griffe.Object, target: str) -> list[str]:
    """The full paths a role's target may mean, most specific scope first."""
    paths = [target]
    scope: griffe.Object | None = obj if obj.is_class or obj.is_module else obj.parent
    while scope is not None:
        paths.append(f"{scope.path}.{target}")
        scope = scope.parent
    return paths


def _exists(loader: griffe.GriffeLoader, path: str) -> bool:
    try:
        loader.modules_collection.get_member(path)
    except (KeyError, ValueError, AttributeError, griffe.AliasResolutionError):
        return False
    return True


class SphinxRoles(griffe.Extension):
    """Rewrite ``:role:`target``` in every docstring as an optional autorefs reference."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Rewrite the roles of every docstring in the package once it is fully loaded."""
        self._walk(pkg, loader)

    def _walk(self, obj: griffe.Object, loader: griffe.GriffeLoader) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(lambda m: self._ref(obj, loader, m), obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias:
                self._walk(member, loader)

    def _ref(self, obj: griffe.Object, loader: griffe.GriffeLoader, match: re.Match[str]) -> str:
        _, tilde, target, call = match.groups()
        shown = (target.rsplit(".", 1)[-1] if tilde else target) + (call or "")
        path = next((p for p in _candidates(obj, target) if _exists(loader, p)), target)
        title = f"<code>{html.escape(shown)}</code>"
        return f'<autoref identifier="{html.escape(path)}" optional>{title}</autoref>'
