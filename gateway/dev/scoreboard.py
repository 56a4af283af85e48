"""The scoreboard's pure parts: cells, their noise, a comparison with an earlier result,
and the tables the README and ``docs/benchmarks.md`` show (issue 37).

``bench/scoreboard.py`` measures; this module only reads what it measured. A result is
JSON::

    {"commit": "7d8819d", "date": "2026-12-06", "quick": false,
     "machine": "2 cores, ...",
     "cells": [{"row": "seed", "cell": {"answer": "whole", "arrivals": "burst"},
                "metrics": {"served_gateway": [3, 3], "upstream_500_direct": [3, 3]}}]}

Each metric holds one value per repeat of its cell (every cell runs at least twice in a
full run), so that a change can be told from noise: :func:`noise` is the spread of the
repeats, and :func:`compare` calls a change *beyond noise* only when the medians differ
by more than the larger spread of the two results.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BLOCKS", "REFERENCE", "Cell", "Change", "compare", "doc_blocks", "latest",
           "load", "markdown", "noise", "splice"]

#: Metrics where a larger value is better (the others: smaller is better, or neither).
HIGHER_IS_BETTER = ("served", "ratio", "rps", "goodput")


@dataclass(frozen=True)
class Cell:
    """One cell of a row: the workload's axes and, per metric, one value per repeat.

    :ivar row: the promise measured (``seed``, ``goodput``, ``overhead``).
    :ivar axes: the workload's coordinates (``{"answer": "stream"}``).
    :ivar metrics: metric name -> values, one per repeat.
    """

    row: str
    axes: Mapping[str, str]
    metrics: Mapping[str, Sequence[float]] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """``row`` and the axes, as a stable text key (``seed answer=whole ...``)."""
        return " ".join([self.row, *(f"{k}={v}" for k, v in sorted(self.axes.items()))])

    def median(self, metric: str) -> float:
        """The median of ``metric``'s repeats.

        :raises KeyError: no such metric.
        """
        return float(statistics.median(self.metrics[metric]))

    def as_json(self) -> dict[str, Any]:
        return {"row": self.row, "cell": dict(self.axes),
                "metrics": {k: list(v) for k, v in self.metrics.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Cell:
        return cls(data["row"], dict(data["cell"]),
                   {k: [float(x) for x in v] for k, v in data["metrics"].items()})


def noise(values: Sequence[float]) -> float:
    """The spread of a metric's repeats (max - min; 0 for one value), in its unit."""
    return float(max(values) - min(values)) if values else 0.0


@dataclass(frozen=True)
class Change:
    """One metric of one cell, an earlier result against this one."""

    key: str
    metric: str
    before: float
    after: float
    spread: float  # the larger of the two results' spreads

    @property
    def beyond_noise(self) -> bool:
        """The medians differ by more than the spread."""
        return abs(self.after - self.before) > self.spread

    @property
    def worse(self) -> bool:
        """Beyond noise, in the bad direction (for a metric with a direction)."""
        if not self.beyond_noise:
            return False
        higher_better = any(w in self.metric for w in HIGHER_IS_BETTER)
        lower_better = any(w in self.metric for w in ("upstream_500", "_s", "_ms", "rss"))
        if higher_better:
            return self.after < self.before
        if lower_better:
            return self.after > self.before
        return False

    def line(self) -> str:
        mark = "WORSE" if self.worse else ("changed" if self.beyond_noise else "same")
        return (f"{self.key}: {self.metric} {_fmt(self.before)} -> {_fmt(self.after)} "
                f"(noise ±{_fmt(self.spread)}) {mark}")


def compare(before: Iterable[Cell], after: Iterable[Cell]) -> list[Change]:
    """Each metric of each cell in both results, earlier against later, in ``after``'s
    order; cells or metrics in only one of them are left out."""
    earlier = {c.key: c for c in before}
    out = []
    for cell in after:
        old = earlier.get(cell.key)
        if old is None:
            continue
        for metric, values in cell.metrics.items():
            if metric not in old.metrics:
                continue
            spread = max(noise(values), noise(old.metrics[metric]))
            out.append(Change(cell.key, metric, old.median(metric), cell.median(metric),
                              spread))
    return out


def load(path: Path) -> tuple[dict[str, Any], list[Cell]]:
    """A result file: its header (commit, date, quick, machine) and its cells.

    :raises OSError, ValueError, KeyError: not a readable result.
    """
    data = json.loads(path.read_text())
    return ({k: v for k, v in data.items() if k != "cells"},
            [Cell.from_json(c) for c in data["cells"]])


def latest(folder: Path) -> Path | None:
    """The newest full (not ``--quick``) result in ``folder`` (by its ``created``
    stamp), or ``None``."""
    best: tuple[str, Path] | None = None
    for path in folder.glob("*.json"):
        head, _ = load(path)
        if head.get("quick"):
            continue
        stamp = str(head.get("created", ""))
        if best is None or stamp > best[0]:
            best = (stamp, path)
    return None if best is None else best[1]


def _fmt(value: float) -> str:
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def _cell_text(cell: Cell, metric: str) -> str:
    values = cell.metrics[metric]
    spread = noise(values)
    text = _fmt(cell.median(metric))
    return text if spread == 0 else f"{text} ±{_fmt(spread / 2)}"


def markdown(cells: Sequence[Cell]) -> str:
    """Every cell as a Markdown table per row: the axes, then each metric's median
    with half its spread (``±``) where the repeats differ."""
    out = []
    for row in dict.fromkeys(c.row for c in cells):
        mine = [c for c in cells if c.row == row]
        axes = list(dict.fromkeys(k for c in mine for k in c.axes))
        metrics = list(dict.fromkeys(m for c in mine for m in c.metrics))
        out.append(f"**{row}**\n")
        out.append("| " + " | ".join(axes + metrics) + " |")
        out.append("|" + "|".join("---" for _ in axes + metrics) + "|")
        for c in mine:
            values = [c.axes.get(a, "") for a in axes]
            values += [_cell_text(c, m) if m in c.metrics else "" for m in metrics]
            out.append("| " + " | ".join(values) + " |")
        out.append("")
    return "\n".join(out)


# -- the blocks the docs show --------------------------------------------------------------

def _seed_block(cells: Sequence[Cell], head: Mapping[str, Any]) -> str:
    """The README's table: the seed overload, whole answers in a burst."""
    cell = next(c for c in cells if c.row == "seed"
                and dict(c.axes) == {"answer": "whole", "arrivals": "burst"})
    m = cell.median
    rows = [("requests", "3", "3"),
            ("served whole", _fmt(m("served_direct")), _fmt(m("served_gateway"))),
            ("upstream 500s", _fmt(m("upstream_500_direct")), _fmt(m("upstream_500_gateway"))),
            ("wall time (s)", f"{m('wall_direct_s'):.1f}", f"{m('wall_gateway_s'):.1f}")]
    lines = ["|                    | straight to llama-server | through the gateway |",
             "|--------------------|--------------------------|---------------------|"]
    lines += [f"| {a:<18} | {b:<24} | {c:<19} |" for a, b, c in rows]
    lines.append(f"\n(`make score`, commit {head.get('commit')}, {head.get('date')}: "
                 f"the median of {len(cell.metrics['served_gateway'])} runs.)")
    return "\n".join(lines)


def _all_block(cells: Sequence[Cell], head: Mapping[str, Any]) -> str:
    """``docs/benchmarks.md``'s table: every row."""
    failed = "".join(f"\n\nRow `{row}` failed in this run: {why}"
                     for row, why in (head.get("failed") or {}).items())
    return (f"Result of `make score` at commit {head.get('commit')} on {head.get('date')} "
            f"({head.get('machine', 'this machine')}); each figure the median of its "
            f"repeats, ± half their spread.{failed}\n\n" + markdown(cells).rstrip())


def _overhead_block(cells: Sequence[Cell], head: Mapping[str, Any]) -> str:
    """The README's overhead table: SSE and JSON throughput against the floor and the
    earlier gateway, and the 2,000-stream burst (the rows ``overhead`` and ``burst``)."""
    def find(row: str, **axes: str) -> Cell | None:
        return next((c for c in cells if c.row == row and dict(c.axes) == axes), None)

    def figures(cell: Cell | None, metrics: Sequence[str]) -> list[str]:
        return [_cell_text(cell, m) if cell is not None and m in cell.metrics else "-"
                for m in metrics]

    throughput = ("rps_gateway", "rps_floor", "rps_other", "ratio_floor", "ratio_other")
    burst = find("burst", streams="2000", arrivals="burst")
    rows = [("SSE streams/s (100 events, 64 connections)",
             figures(find("overhead", body="sse"), throughput)),
            ("JSON requests/s (64 connections)", figures(find("overhead", body="json"),
                                                        throughput)),
            ("2,000 streams opened at once: first event p95 (s)",
             figures(burst, ("first_event_p95_s_gateway", "first_event_p95_s_floor",
                             "first_event_p95_s_other")) + ["", ""]),
            ("the same: peak RSS (MiB)",
             figures(burst, ("peak_rss_mib_gateway", "peak_rss_mib_floor",
                             "peak_rss_mib_other")) + ["", ""])]
    other = str(head.get("against", REFERENCE))
    lines = [f"| | gateway | bare pass-through | gateway at {other} | gateway ÷ pass-through "
             f"| gateway ÷ {other} |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join([name, *values]) + " |" for name, values in rows]
    sse, json_ = find("overhead", body="sse"), find("overhead", body="json")
    if sse is not None and json_ is not None and "ratio_traced" in sse.metrics \
            and "ratio_traced" in json_.metrics:
        lines.append(f"\nWith OpenTelemetry tracing on (every request sampled, OTLP/HTTP): "
                     f"{_cell_text(sse, 'ratio_traced')}x the SSE throughput without it, "
                     f"{_cell_text(json_, 'ratio_traced')}x the JSON ([Traces](docs/traces.md)).")
    lines.append(f"\n(`make score`, commit {head.get('commit')}, {head.get('date')}, "
                 f"{head.get('machine', 'this machine')}: the median of each figure's "
                 "repeats, ± half their spread.)")
    return "\n".join(lines)


def _shared_block(cells: Sequence[Cell], head: Mapping[str, Any]) -> str:
    """The README's table of several processes sharing Redis (the row ``shared``): one
    gateway process against two sharing a ``redis-server``, whole and streamed."""
    rows = [c for c in cells if c.row == "shared"]
    lines = ["| 3 chats of ~790 + 300 tokens | one process | two processes sharing Redis "
             "| goodput, two ÷ one |", "|---|---|---|---|"]
    for cell in rows:
        def side(name: str, c: Cell = cell) -> str:
            return (f"{_fmt(c.median(f'served_{name}'))} served, "
                    f"{_fmt(c.median(f'upstream_500_{name}'))} upstream 500s, "
                    f"{_cell_text(c, f'wall_s_{name}')} s")
        answer = {"stream": "streamed"}.get(cell.axes.get("answer", ""), cell.axes.get("answer"))
        lines.append(f"| {answer} answers | {side('one')} | {side('two')} | "
                     f"{_cell_text(cell, 'goodput_ratio')} |")
    if not rows:
        lines.append("| (not measured in this result) | | | |")
    lines.append(f"\n(`make score`, commit {head.get('commit')}, {head.get('date')}, "
                 f"{head.get('machine', 'this machine')}: the median of each figure's "
                 "repeats, ± half their spread.)")
    return "\n".join(lines)


#: The gateway the overhead and burst rows are measured against by default (the last
#: commit before the relay was split into layers: issue 37's SSE figure).
REFERENCE = "7117abb"

#: The generated blocks: name -> (the files that show it, builder). A block sits
#: between ``<!-- score:NAME -->`` and ``<!-- /score:NAME -->`` in each of its files.
BLOCKS = {
    "seed": (("README.md", "docs/index.md"), _seed_block),
    "all": (("docs/benchmarks.md",), _all_block),
    "overhead": (("README.md",), _overhead_block),
    "shared": (("README.md",), _shared_block),
}


def doc_blocks(head: Mapping[str, Any], cells: Sequence[Cell]) -> dict[str, str]:
    """Each generated block's text for this result (name -> Markdown)."""
    return {name: build(cells, head) for name, (_, build) in BLOCKS.items()}


def splice(text: str, name: str, block: str) -> str:
    """``text`` with the block ``name`` replaced by ``block``.

    :raises ValueError: ``text`` has no such block (its two markers).
    """
    begin, end = f"<!-- score:{name} -->", f"<!-- /score:{name} -->"
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"no block {name!r} ({begin} ... {end})")
    return text[:i + len(begin)] + "\n" + block.strip() + "\n" + text[j:]
