"""The soak: minutes of overload and faults against a real llama-server; see
gateway/dev/soak.py for what it runs and prints.

Usage: .venv/bin/python bench/soak.py [--duration 300] [--rate R] [--policy strict|predictive]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.dev.soak import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
