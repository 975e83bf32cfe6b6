"""Command-line entry: same as `python -m cuattn compile` (options: cuattn/tools/compile_check.py).

PYTHONPATH=. python scripts/compile_check.py --help
"""

from __future__ import annotations

import sys

from cuattn.tools.compile_check import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
