"""The scoreboard (issue 37): its pure parts (gateway/dev/scoreboard.py), one cell of it
run for real on the fake upstream, and the docs' tables against the latest committed
result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.dev.scoreboard import (
    BLOCKS,
    Cell,
    compare,
    doc_blocks,
    latest,
    load,
    markdown,
    noise,
    splice,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def seed_cell(served: list[float], errors: list[float]) -> Cell:
    return Cell("seed", {"answer": "whole", "arrivals": "burst"}, {
        "served_direct": [0, 0], "upstream_500_direct": [3, 3],
        "wall_direct_s": [2.7, 2.9], "served_gateway": served,
        "upstream_500_gateway": errors, "wall_gateway_s": [34.0, 36.0]})


def test_noise_is_the_spread_of_the_repeats() -> None:
    assert noise([0.5, 0.7, 0.6]) == pytest.approx(0.2)
    assert noise([3.0]) == 0.0 and noise([]) == 0.0


def test_a_cell_round_trips_through_json_and_keys_by_its_axes() -> None:
    cell = seed_cell([3, 3], [0, 0])
    again = Cell.from_json(json.loads(json.dumps(cell.as_json())))
    assert again == Cell(cell.row, dict(cell.axes), {k: list(map(float, v))
                                                    for k, v in cell.metrics.items()})
    assert cell.key == "seed answer=whole arrivals=burst"
    assert cell.median("wall_gateway_s") == 35.0


def test_a_change_within_the_noise_is_not_a_regression() -> None:
    before = [Cell("overhead", {"body": "sse"}, {"ratio_floor": [0.40, 0.46]})]
    within = [Cell("overhead", {"body": "sse"}, {"ratio_floor": [0.41, 0.44]})]
    worse = [Cell("overhead", {"body": "sse"}, {"ratio_floor": [0.25, 0.27]})]
    (same,) = compare(before, within)
    assert not same.beyond_noise and not same.worse
    (drop,) = compare(before, worse)
    assert drop.beyond_noise and drop.worse and "WORSE" in drop.line()


def test_more_upstream_500s_or_a_longer_wall_is_worse_and_fewer_is_not() -> None:
    (more,) = [c for c in compare([seed_cell([3, 3], [0, 0])], [seed_cell([3, 3], [2, 2])])
               if c.metric == "upstream_500_gateway"]
    assert more.worse
    (fewer,) = [c for c in compare([seed_cell([3, 3], [2, 2])], [seed_cell([3, 3], [0, 0])])
                if c.metric == "upstream_500_gateway"]
    assert fewer.beyond_noise and not fewer.worse


def test_cells_only_in_one_result_are_left_out_of_the_comparison() -> None:
    assert compare([seed_cell([3, 3], [0, 0])],
                   [Cell("overhead", {"body": "json"}, {"ratio_floor": [0.5, 0.5]})]) == []


def test_the_table_shows_each_median_and_half_the_spread() -> None:
    text = markdown([seed_cell([3, 3], [0, 0]),
                     Cell("overhead", {"body": "sse"}, {"ratio_floor": [0.4, 0.5]})])
    assert "**seed**" in text and "**overhead**" in text
    assert "| whole | burst | 0 | 3 | 2.8 ±0.1 | 3 | 0 | 35 ±1 |" in text
    assert "| sse | 0.45 ±0.05 |" in text


def test_splice_replaces_only_its_block_and_refuses_a_missing_one() -> None:
    text = "a\n<!-- score:seed -->\nold\n<!-- /score:seed -->\nb\n"
    assert splice(text, "seed", "new") == ("a\n<!-- score:seed -->\nnew\n"
                                          "<!-- /score:seed -->\nb\n")
    with pytest.raises(ValueError, match="no block 'all'"):
        splice(text, "all", "x")


def test_the_readme_block_is_the_seed_overload_from_the_result() -> None:
    head = {"commit": "abc1234", "date": "2026-12-06"}
    block = doc_blocks(head, [seed_cell([3, 3], [0, 0])])["seed"]
    assert "| served whole       | 0                        | 3                   |" in block
    assert "| upstream 500s      | 3                        | 0                   |" in block
    assert "commit abc1234, 2026-12-06" in block


def test_the_readme_overhead_block_shows_throughput_and_the_burst() -> None:
    head = {"commit": "abc1234", "date": "2026-12-07", "against": "7117abb"}
    sse = Cell("overhead", {"body": "sse"}, {
        "rps_floor": [800, 820], "rps_gateway": [470, 490], "rps_other": [430, 440],
        "ratio_floor": [0.59, 0.6], "ratio_other": [1.09, 1.11], "errors_gateway": [0, 0]})
    burst = Cell("burst", {"streams": "2000", "arrivals": "burst"}, {
        "first_event_p95_s_gateway": [3.1, 3.3], "first_event_p95_s_floor": [2.5, 2.5],
        "first_event_p95_s_other": [4.5, 4.7], "peak_rss_mib_gateway": [180, 184],
        "peak_rss_mib_floor": [156, 156], "peak_rss_mib_other": [170, 176]})
    block = doc_blocks(head, [seed_cell([3, 3], [0, 0]), sse, burst])["overhead"]
    assert "| SSE streams/s (100 events, 64 connections) | 480 ±10 | 810 ±10 | 435 ±5 |" \
        in block
    assert "| 0.595 ±0.005 | 1.1 ±0.01 |" in block
    assert "first event p95 (s) | 3.2 ±0.1 | 2.5 | 4.6 ±0.1 |" in block
    assert "gateway at 7117abb" in block and "commit abc1234, 2026-12-07" in block
    # A result without those rows shows dashes, not a failure.
    assert "| JSON requests/s (64 connections) | - | - | - | - | - |" in block


def test_the_readme_shared_block_is_the_redis_row_from_the_result() -> None:
    head = {"commit": "abc1234", "date": "2026-12-07"}
    whole = Cell("shared", {"answer": "whole"}, {
        "served_one": [3, 3], "upstream_500_one": [0, 0], "wall_s_one": [20, 22],
        "served_two": [3, 3], "upstream_500_two": [1, 1], "wall_s_two": [19, 19],
        "goodput_ratio": [1.0, 1.2]})
    block = doc_blocks(head, [seed_cell([3, 3], [0, 0]), whole])["shared"]
    assert ("| whole answers | 3 served, 0 upstream 500s, 21 ±1 s "
            "| 3 served, 1 upstream 500s, 19 s | 1.1 ±0.1 |") in block
    assert "commit abc1234, 2026-12-07" in block
    assert "not measured" in doc_blocks(head, [seed_cell([3, 3], [0, 0])])["shared"]


def test_the_fakes_row_measures_ollama_and_vllm_straight_and_through() -> None:
    """The row on the faithful fakes (in process, a second): what Ollama alone cuts
    and vLLM alone preempts, the gateway refuses or queues, for a model named in the
    configuration and one named only in the request."""
    sys.path.insert(0, str(ROOT / "bench"))
    import fakes_row

    cells = {c.key: c for c in fakes_row.row_fakes(fakes_row.CELLS, 1)}
    for named in ("configured", "request"):
        cell = cells[f"fakes backend=ollama model={named}"]
        assert cell.median("cut_direct") == 1 and cell.median("cut_gateway") == 0
        assert cell.median("refused_400_gateway") == 1
        assert cell.median("forwarded_gateway") == 0
    vllm = cells["fakes backend=vllm model=configured"]
    assert vllm.median("served_direct") == vllm.median("served_gateway") == 6
    assert vllm.median("preemptions_direct") > 0 == vllm.median("preemptions_gateway")
    assert vllm.median("peak_running_gateway") == 4


def test_one_cell_runs_for_real_on_the_fake_upstream(tmp_path: Path) -> None:
    """The scoreboard's smoke test: the overhead row's first cell, once, for a second,
    against bench/bench.py's fake upstream (no llama-server). Its figures are not
    judged (no timed assertion), its shape and its errors are."""
    out = tmp_path / "r.json"
    # Against this very commit's gateway (git archive of HEAD, kept under this HOME).
    done = subprocess.run([sys.executable, "bench/scoreboard.py", "--rows", "overhead",
                           "--quick", "--seconds", "1", "--out", str(out), "--against",
                           "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    (tree,) = (tmp_path / ".cache" / "llm-gateway" / "trees").iterdir()
    assert (tree / "gateway" / "__main__.py").is_file()
    head, cells = load(out)
    assert head["quick"] is True and head["rows"] == ["overhead"]
    (cell,) = cells
    assert cell.row == "overhead" and dict(cell.axes) == {"body": "sse"}
    assert set(cell.metrics) >= {"rps_floor", "rps_gateway", "ratio_floor", "errors_gateway",
                                 "rps_other", "ratio_other"}
    assert cell.median("errors_gateway") == 0 and cell.median("rps_gateway") > 0
    assert "**overhead**" in done.stdout


def test_the_docs_show_the_latest_committed_result() -> None:
    """The README's and docs/benchmarks.md's generated tables are those of the newest
    full result in bench/results (regenerate with ``bench/scoreboard.py --write-docs``
    or ``make score``)."""
    newest = latest(RESULTS)
    assert newest is not None, "no full scoreboard result committed in bench/results"
    head, cells = load(newest)
    for name, block in doc_blocks(head, cells).items():
        for file in BLOCKS[name][0]:
            text = (ROOT / file).read_text()
            assert splice(text, name, block) == text, (
                f"{file}'s block {name!r} is not {newest.name}'s: run "
                f"python bench/scoreboard.py --write-docs (or make score)")


def test_a_row_that_fails_is_run_again_then_left_out_and_said(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing row (a request the slo row sent straight to llama-server on a connection
    it had closed lost a whole 28-minute run)
    is run once more; a second failure leaves it out, and the result says so."""
    sys.path.insert(0, str(ROOT / "bench"))
    import fakes_row
    import scoreboard

    calls: list[int] = []

    def flaky(cells: list[dict[str, str]], repeats: int) -> list[Cell]:
        calls.append(repeats)
        if len(calls) == 1:
            raise RuntimeError("llama-server exited")
        return [Cell("fakes", {"backend": "vllm"}, {"served_gateway": [6]})]

    monkeypatch.setattr(fakes_row, "row_fakes", flaky)
    cells, failed = scoreboard.run(["fakes"], quick=True, repeats=1, seconds=1)
    assert [c.key for c in cells] == ["fakes backend=vllm"] and len(calls) == 2
    assert failed == {"fakes": "attempt 1: RuntimeError('llama-server exited')"}

    def broken(cells: list[dict[str, str]], repeats: int) -> list[Cell]:
        raise RuntimeError("always")

    monkeypatch.setattr(fakes_row, "row_fakes", broken)
    cells, failed = scoreboard.run(["fakes"], quick=True, repeats=1, seconds=1)
    assert cells == [] and "attempt 2" in failed["fakes"]
    block = doc_blocks({"commit": "abc", "failed": failed}, [seed_cell([3, 3], [0, 0])])["all"]
    assert "Row `fakes` failed in this run: attempt 1" in block
