"""KV-cache policies on a tiny language model: kept bytes, agreement, perplexity, tokens/s.

    python scripts/generate.py --markdown table.md --png plot.png
(from the repository root with cuattn installed, or PYTHONPATH=.); the same as
``cuattn generate``, whose module (cuattn/tools/generate.py) documents the measurement.
"""

import argparse
import os
import sys

# Tiny matrices: BLAS threads cost more in hand-offs than they save (see train_tiny.py).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from cuattn.tools import generate  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    generate.add_arguments(parser)
    sys.exit(generate.run(parser.parse_args()))
