"""Timing and memory measurement for the benchmark: CUDA events on a GPU, perf_counter on CPU.

Every timed call gets an index; callers use it to rotate through several input sets so that a
run never finds its inputs already in L2 from the previous one.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

# Input sets together should exceed L2 (50 MB on H100, 60 MB on H200) several times over.
ROTATION_BYTES = 256 * 1024 * 1024
MAX_INPUT_SETS = 8
MS_PER_S = 1e3

RunFn = Callable[[int], Any]


def input_sets_needed(bytes_per_set: int) -> int:
    """How many input sets to rotate through so their total exceeds ROTATION_BYTES."""
    return max(1, min(MAX_INPUT_SETS, math.ceil(ROTATION_BYTES / max(1, bytes_per_set))))


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    runs: int

    def as_dict(self) -> dict[str, float | int]:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "runs": self.runs}


class Timer(Protocol):
    name: str

    def time(self, fn: RunFn, warmup: int, repeats: int) -> Timing: ...

    def peak_bytes(self, fn: RunFn) -> int | None: ...

    def synchronize(self) -> None: ...


class CudaEventTimer:
    """Times each run with its own pair of CUDA events on torch's current stream."""

    name = "cuda-events"

    def __init__(self) -> None:
        import torch

        self._torch = torch

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()

    def time(self, fn: RunFn, warmup: int, repeats: int) -> Timing:
        cuda = self._torch.cuda
        for i in range(warmup):
            fn(i)
        starts = [cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [cuda.Event(enable_timing=True) for _ in range(repeats)]
        for i in range(repeats):
            starts[i].record()
            fn(warmup + i)
            ends[i].record()
        cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
        return Timing(statistics.median(times), min(times), repeats)

    def peak_bytes(self, fn: RunFn) -> int | None:
        """Peak bytes allocated above what was already live, through torch's allocator (CuPy
        allocations are routed there by `torch_allocator_for_cupy`)."""
        cuda = self._torch.cuda
        cuda.synchronize()
        before = cuda.memory_allocated()
        cuda.reset_peak_memory_stats()
        fn(0)
        cuda.synchronize()
        return cuda.max_memory_allocated() - before


class CpuTimer:
    """perf_counter timing for the CPU dry run (no warm-up effects worth modelling)."""

    name = "perf-counter"

    def synchronize(self) -> None:
        return None

    def time(self, fn: RunFn, warmup: int, repeats: int) -> Timing:
        for i in range(warmup):
            fn(i)
        times = []
        for i in range(repeats):
            start = time.perf_counter()
            fn(warmup + i)
            times.append((time.perf_counter() - start) * MS_PER_S)
        return Timing(statistics.median(times), min(times), repeats)

    def peak_bytes(self, fn: RunFn) -> int | None:
        return None


def median_ms(fn: Callable[[], Any], sync: Callable[[], Any], repeats: int) -> float:
    """Median wall milliseconds of ``fn`` (one untimed warm-up call), ``sync`` after each call
    (torch.cuda.synchronize, a CuPy device's synchronize, or a no-op on the CPU)."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
