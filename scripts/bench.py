"""Command-line entry: same as `python -m cuattn bench` (see cuattn/tools/bench/run.py for options).

PYTHONPATH=. python scripts/bench.py --help
"""

from __future__ import annotations

import sys

from cuattn.tools.bench.run import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
