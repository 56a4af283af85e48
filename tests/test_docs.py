"""The documentation: the MkDocs site under ``docs/`` builds strictly, its API reference
has a page for every module of ``gateway/``, and ``README.md`` is a front page whose links
all resolve.

The build runs ``mkdocs build --strict`` into a temporary directory, so a broken link or
anchor, a page missing from the nav, a nav entry without a page, or a docstring that
mkdocstrings cannot render fails the suite. Any line the build logs at WARNING or ERROR
fails it too, in case a plugin logs one that ``--strict`` does not count.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

#: ``[text](target)`` and ``![alt](target)``, outside code; the target ends at a space
#: (a title) or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def build(site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of the repository's site into ``site``; its output."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built site; the build's failure, with its log, fails every test that uses it."""
    out = tmp_path_factory.mktemp("site")
    result = build(out)
    log = result.stdout + result.stderr
    problems = [line for line in log.splitlines()
                if re.search(r"\b(WARNING|ERROR)\b", re.sub(r"\x1b\[[0-9;]*m", "", line))]
    assert result.returncode == 0 and not problems, (
        f"mkdocs build --strict failed (exit {result.returncode}):\n{log}")
    return out


def prose(text: str) -> str:
    """Markdown without its fenced code blocks and inline code spans (links there are text)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def headings(page: Path) -> set[str]:
    """The anchors of a Markdown page's headings, as the toc extension makes them."""
    anchors = set()
    for line in prose(page.read_text(encoding="utf-8")).splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            anchors.add(slugify(m.group(1).replace("`", ""), "-"))
    return anchors


def test_the_site_builds_strictly(site: Path) -> None:
    assert (site / "index.html").is_file()
    # The status page's screenshot (rewritten by tests/integration/test_status_browser.py).
    assert (DOCS / "status.png").is_file() and (site / "status.png").is_file()


def test_every_module_of_the_package_has_an_api_page(site: Path) -> None:
    missing = []
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        page = site / "reference" / ".".join(parts) / "index.html"
        if not page.is_file():
            missing.append(".".join(parts))
    assert not missing, f"no API reference page for {missing}"


def test_every_docs_page_is_in_the_site(site: Path) -> None:
    for page in DOCS.glob("*.md"):
        built = site / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert built.is_file(), page


def test_the_readme_is_a_front_page() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 300, "the README is a front page; the reference is docs/"
    commands = re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M)
    assert any(re.search(r"^make run\b", c, re.M) and re.search(r"^make test\b", c, re.M)
               for c in commands), "the two set-up commands, in one block"
    for needle in ("from openai import OpenAI", "from anthropic import Anthropic",
                   "from ollama import Client", "/v1/chat/completions"):
        assert needle in text, needle
    # The measured table of the overflow, the same on the front page and the docs' home:
    # the scoreboard's block (its figures checked in tests/test_scoreboard.py).
    home = (DOCS / "index.md").read_text(encoding="utf-8")
    block = re.compile(r"<!-- score:seed -->\n(.*?)<!-- /score:seed -->", re.S)
    ours, theirs = block.search(text), block.search(home)
    assert ours and theirs and "| upstream 500s" in ours.group(1)
    assert ours.group(1) == theirs.group(1)


def resolve(source: Path, target: str) -> str | None:
    """Why ``target``, a link in ``source``, does not resolve (None when it does)."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
        return None
    path, _, anchor = target.partition("#")
    file = (source.parent / path).resolve() if path else source
    if not file.is_relative_to(ROOT) or not file.exists():
        return "no such file in the repository"
    if anchor and file.suffix == ".md" and anchor not in headings(file):
        return f"no heading #{anchor} in {file.relative_to(ROOT)}"
    return None


def test_every_link_of_the_readme_resolves() -> None:
    links = LINK.findall(prose(README.read_text(encoding="utf-8")))
    assert len(links) >= 15, links
    broken = {t: why for t in links if (why := resolve(README, t))}
    assert not broken, broken
    assert any(t.startswith("docs/") for t in links)


def test_the_link_check_sees_a_broken_link() -> None:
    page = ROOT / "docs" / "index.md"
    assert resolve(page, "capacity.md#abandoned-requests") is None
    assert resolve(page, "capacity.md#no-such-heading")
    assert resolve(page, "no-such-page.md")
    assert resolve(README, "docs/status.png") is None


def test_the_development_page_names_every_runtime_module() -> None:
    # The package map on the Development page lists each module of the runtime by path,
    # so a module added or moved without a line there fails here.
    page = (ROOT / "docs" / "development.md").read_text()
    runtime = [p for p in (ROOT / "gateway").rglob("*.py")
               if p.relative_to(ROOT / "gateway").parts[0] not in ("planner", "dev")
               and p.name != "__init__.py" and p.name != "__main__.py"]
    missing = [str(p.relative_to(ROOT)) for p in runtime
               if str(p.relative_to(ROOT)) not in page]
    assert missing == []
