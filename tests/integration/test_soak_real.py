"""The soak (gateway/dev/soak.py, bench/soak.py) for 60 s against the real llama-server:
open-loop overload at 3x the calibrated service rate, clients that leave, trickle or
send malformed bodies, the backend killed, restarted with another layout, frozen and
killed again, and the gateway's configuration reloaded. Shorter answers than the 5-minute soak (caps up to 128, prompts up to
600 tokens) so that every request can end within the test's time."""

from __future__ import annotations

import pytest

from gateway.dev.soak import SoakOptions, problems, run_soak

pytestmark = pytest.mark.llama


@pytest.mark.timeout(900)
def test_a_60_s_soak_keeps_every_promise() -> None:
    lines: list[str] = []
    report = run_soak(SoakOptions(duration_s=60, calibrate_s=20, max_prompt_tokens=600,
                                  max_cap=128, default_max_tokens=128, grace_s=30),
                      say=lines.append)
    text = "\n".join(lines + report.lines())
    # A 60 s run is too short for memory to settle: the start is measured after a calm
    # calibration, the end after a peak of ~100 requests in hand (one CI run: +59%,
    # another +3%). So RSS is held only against gross growth here; the 5-minute soak
    # (bench/soak.py) holds it to 10%.
    assert problems(report, max_rss_growth=1.0) == [], text
    assert report.sent >= 10, text
    assert len(report.faults) == 4, text
    assert any("changed backend local" in fault for fault in report.faults), text
    assert report.fds_end - report.fds_start < 20, text
    served = sum(n for outcome, n in report.outcomes.items() if outcome.startswith("200"))
    assert served >= 3, text
    assert any(outcome.startswith("503") for outcome in report.outcomes), text  # overload
