"""Compile every kernel instantiation for this machine's GPU into the disk caches, in parallel.

    PYTHONPATH=. python scripts/warm_kernels.py [--jobs N] [--filter TEXT]

Run before the GPU tests or the benchmark so that neither spends minutes compiling serially. On
an sm_90 GPU (H100/H200) the sm_90a family's cubins (the forward, and the backward that
CUATTN_KERNELS=sm90a selects) are built too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from cuattn.backends import geometry
from cuattn.backends.cuda_runtime import cupy_module, warm_disk_cache


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
    device = cupy_module().cuda.Device()
    sm90_units = [
        (config.source_file, config.name_expression)
        for config in (*geometry.sm90_configs(), *geometry.sm90_backward_configs())
        if args.filter in config.name_expression
    ]
    if device.compute_capability == geometry.SM90_COMPUTE_CAPABILITY and sm90_units:
        warm_disk_cache(sm90_units, args.jobs, progress=sys.stderr, arch=geometry.SM90_ARCH)
        units += sm90_units
    sys.stderr.write(f"{len(units)} instantiations in {time.perf_counter() - start:.0f}s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
