"""Compile every kernel instantiation for this machine's GPU into CuPy's disk cache, in parallel.

    PYTHONPATH=. python scripts/warm_kernels.py [--jobs N] [--filter TEXT]

Run before the GPU tests or the benchmark so that neither spends minutes compiling serially.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from cuattn.backends import geometry
from cuattn.backends.cuda_runtime import warm_disk_cache


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--filter", default="", help="only name expressions containing this")
    args = parser.parse_args()
    units = [
        (source_file, name)
        for source_file, names in geometry.all_instantiations().items()
        for name in names
        if args.filter in name
    ]
    start = time.perf_counter()
    warm_disk_cache(units, args.jobs, progress=sys.stderr)
    sys.stderr.write(f"{len(units)} instantiations in {time.perf_counter() - start:.0f}s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
