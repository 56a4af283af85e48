"""How far the gateway's local prompt estimate is from a backend's own count.

Prints, for a corpus of chats (English prose, code, digits, non-English text, short and
long), the relative error (estimate - truth) / truth of the raw estimate (no margin) and
of the charged one (``estimate_margin`` 1.25), against:

* the fake Ollama's tokenizer (tests/fake_ollama.py), always;
* a real llama-server's own count (``/v1/chat/completions/input_tokens``), when
  ``--llama URL`` is given (for example the Gemma 3 270M server of ``make run``).

Usage: python bench/estimate_error.py [--llama http://127.0.0.1:8080]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.request.tokens import chat_text, estimate_tokens  # noqa: E402
from tests.fake_ollama import FakeOllama  # noqa: E402

WORDS = ["river", "mountain", "quiet", "lantern", "orchard", "copper", "meadow", "signal"]


def corpus() -> list[list[dict[str, str]]]:
    """Chats of varied text; each a list of messages."""
    root = Path(__file__).resolve().parent.parent
    # The prose of the documentation, in the order of the README it came from.
    pages = ("index", "quickstart", "deploy", "benchmarks", "capacity", "policies", "backends")
    prose = "\n\n".join((root / "docs" / f"{page}.md").read_text() for page in pages)
    paragraphs = [p for p in prose.split("\n\n") if len(p) > 200][:40]
    code = (root / "gateway" / "core" / "capacity.py").read_text()
    chats = [[{"role": "user", "content": p}] for p in paragraphs]
    chats += [[{"role": "user", "content": code[i:i + 1500]}] for i in range(0, 6000, 1500)]
    chats += [[{"role": "system", "content": "You are terse."},
               {"role": "user", "content": " ".join(WORDS[(i * j) % 8] for j in range(n))}]
              for i, n in enumerate((10, 50, 200, 800))]
    chats += [[{"role": "user", "content": " ".join(str(7 ** k) for k in range(60))}]]
    chats += [[{"role": "user", "content": "Le renard brun saute par-dessus le chien "
                                            "paresseux, puis s'endort près du ruisseau. " * 8}],
              [{"role": "user", "content": "Der schnelle braune Fuchs springt über den "
                                            "faulen Hund und schläft am Bach ein. " * 8}]]
    return chats


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama", help="a llama-server base URL to count with")
    args = parser.parse_args()
    fake = FakeOllama()
    rows: dict[str, list[tuple[float, float]]] = {"fake Ollama": []}
    if args.llama:
        rows["llama-server"] = []
    async with httpx.AsyncClient(timeout=60) as client:
        for messages in corpus():
            body = {"messages": messages}
            text, n = chat_text(body)
            raw = await estimate_tokens(text, messages=n, margin=1.0)
            charged = await estimate_tokens(text, messages=n, margin=1.25)
            truths = {"fake Ollama": fake.prompt_tokens(body)}
            if args.llama:
                r = await client.post(args.llama + "/v1/chat/completions/input_tokens",
                                      json=body)
                truths["llama-server"] = r.json()["input_tokens"]
            for name, truth in truths.items():
                rows[name].append(((raw - truth) / truth, (charged - truth) / truth))
    print(f"{len(corpus())} chats")  # noqa: T201
    print("| truth | estimate | min | p5 | median | p95 | max | under-counted |")  # noqa: T201
    print("|---|---|---|---|---|---|---|---|")  # noqa: T201
    for name, errs in rows.items():
        for label, idx in (("raw (no margin)", 0), ("charged (x1.25)", 1)):
            e = sorted(x[idx] for x in errs)
            q = statistics.quantiles(e, n=20)
            under = sum(x < 0 for x in e)
            print(f"| {name} | {label} | {e[0]:+.0%} | {q[0]:+.0%} | "  # noqa: T201
                  f"{statistics.median(e):+.0%} | {q[-1]:+.0%} | {e[-1]:+.0%} | "
                  f"{under}/{len(e)} |")


if __name__ == "__main__":
    asyncio.run(main())
