"""Interactive users behind a batch job, with and without tenants: one real llama-server
(Gemma 3 270M, -c 2048, 4 slots), the same scenario through two gateways in one run.

A batch tenant submits N long requests (48 tokens each, ignore_eos); 1.5 s later an
interactive tenant submits 4 short ones. ``fifo``: the gateway without tenants (one
FIFO queue). ``fair``: tenants web (class interactive) and batch (class batch). Printed:
each interactive request's queue wait (the gateway's x-queue-wait-ms), how many batch
answers ended before the last interactive one, the batch requests' slot hold, and the
ratio of the waits.

Usage: .venv/bin/python bench/tenants.py [--batch 40] [--interactive 4]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.dev.localbackend import LlamaServer  # noqa: E402
from gateway.dev.tenants_run import fair_settings, gateway_at, run_scenario  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=40)
    parser.add_argument("--interactive", type=int, default=4)
    args = parser.parse_args()
    with LlamaServer(["-c", "2048"]).running() as server:
        fifo_sections = {k: v for k, v in fair_settings(server.url).items()
                         if k not in ("tenants", "classes")}
        with gateway_at(fifo_sections) as url:
            fifo = asyncio.run(run_scenario(url, batch=args.batch,
                                            interactive=args.interactive,
                                            keys=(None, None), finish_batch=True))
        with gateway_at(fair_settings(server.url)) as url:
            fair = asyncio.run(run_scenario(url, batch=args.batch,
                                            interactive=args.interactive))
    print(f"{'':6} {'interactive waits (s)':34} {'batch done first':>16} "  # noqa: T201
          f"{'batch hold p50 (s)':>18}")
    for name, out in (("fifo", fifo), ("fair", fair)):
        s = out.summary()
        waits = " ".join(f"{w:.2f}" for w in sorted(out.interactive_wait_s))
        print(f"{name:6} {waits:34} {out.batch_done_before_interactive:>16} "  # noqa: T201
              f"{s['batch_hold_p50_s']:>18.2f}")
    ratio = fifo.summary()["interactive_wait_p50_s"] / max(
        0.001, fair.summary()["interactive_wait_p50_s"])
    print(f"interactive wait p50, fifo / fair: x{ratio:.0f}")  # noqa: T201


if __name__ == "__main__":
    main()
