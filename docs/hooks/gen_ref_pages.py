"""Write one API reference page per module of ``gateway/`` (run by mkdocs-gen-files).

Every ``.py`` file under ``gateway/`` (the running server's layers, the command line, the
offline planner ``gateway/planner/`` and the development tooling ``gateway/dev/``) gets a
page ``reference/<dotted.name>.md`` holding a mkdocstrings directive, and
``reference/SUMMARY.md`` lists them for mkdocs-literate-nav, so a module added or moved
appears in the site with no edit here. ``reference/index.md`` is a table of every module
with the first paragraph of its docstring.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gateway"
#: A Sphinx role (``:class:`~a.b.C```), shown in the summary table as code.
ROLE = re.compile(r":[a-z]+:`(~?)([\w.]+(?:\(\))?)`")


def _code(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def modules() -> list[tuple[str, Path]]:
    """The dotted name and path of every module of the package, in import-path order."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found.append((".".join(parts), path))
    if not found:
        raise SystemExit(f"no module found under {PACKAGE}")
    return found


def summary_line(path: Path) -> str:
    """The first paragraph of a module's docstring on one line, its roles as code ("" without)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    return ROLE.sub(_code, first).replace("|", "\\|")


nav = mkdocs_gen_files.Nav()
rows = []
for name, path in modules():
    page = f"{name}.md"
    # A part such as __main__ is written as code, or Markdown reads its underscores as
    # emphasis in the navigation.
    nav[tuple(f"`{part}`" if part.startswith("_") else part
              for part in name.split("."))] = page
    rows.append(f"| [`{name}`]({page}) | {summary_line(path)} |")
    with mkdocs_gen_files.open(f"reference/{page}", "w") as out:
        out.write(f"::: {name}\n")
    mkdocs_gen_files.set_edit_path(f"reference/{page}", path.relative_to(ROOT))

with mkdocs_gen_files.open("reference/index.md", "w") as out:
    out.write("# API reference\n\n")
    out.write(
        "Generated from the docstrings of every module under `gateway/`: the layers of the "
        "running gateway, the command line (`gateway.__main__`), the offline planner "
        "(`gateway.planner`, used by `gateway plan` and `gateway probe` only) and the "
        "development tooling (`gateway.dev`, behind `make run` and `make test`). A module "
        "added under `gateway/` appears here with no edit. The layers and the rule between "
        "them are on the [Development](../development.md#layout) page.\n\n"
    )
    out.write("| module | what it is |\n|---|---|\n")
    out.write("\n".join(rows) + "\n")

with mkdocs_gen_files.open("reference/SUMMARY.md", "w") as out:
    out.write("* [Overview](index.md)\n")
    out.writelines(nav.build_literate_nav())
