"""The dQ reduction primitives of the sm_90a backward under the CPU interpreter: the bulk reduce
into global memory (kernels/common/tma.cuh, the PTX ISA's cp.reduce.async.bulk .add.f32) and the
semaphores ordering it across CTAs (kernels/common/semaphore.cuh). Each misuse a GPU punishes by
timing (a wrong sum, a hang) fails the launch with a message; its fixed twin passes."""

from __future__ import annotations

import numpy as np
import pytest

from cuattn.backends import interp
from tests.backends.test_interp_hopper import SOURCE as HOPPER_SOURCE
from tests.backends.test_interp_hopper import sm90a_opcodes
from tests.helpers.interp_run import run

SOURCE = HOPPER_SOURCE.parent / "bulk_reduce.cu"
THREADS = 64  # bulk_reduce.cu REDUCE_THREADS
FLOATS = 256  # REDUCE_FLOATS
ITEMS = 4
BUGS = {
    "ok": 0,
    "early reuse": 1,
    "early release": 2,
    "no fence": 3,
    "wrong order": 4,
    "block index": 5,
}
EXPRESSIONS = [f"test_ordered_reduce<{bug}>" for bug in BUGS.values()]


@pytest.fixture(scope="module")
def lib() -> interp.Library:
    return interp.build_library(SOURCE, EXPRESSIONS)


def ordered_reduce(lib, bug: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    values = rng.standard_normal((ITEMS, FLOATS)).astype(np.float32) * 1e3
    start = rng.standard_normal(FLOATS).astype(np.float32)
    total = start.copy()
    counters = np.zeros(2, np.int32)
    run(
        lib,
        f"test_ordered_reduce<{BUGS[bug]}>",
        ITEMS,
        THREADS,
        values,
        total,
        counters,
        ITEMS,
        smem=FLOATS * 4,
    )
    expected = start.copy()
    for item in values:  # float32 adds in item order
        expected = expected + item
    return total, expected


def test_ordered_bulk_reduces_sum_in_claim_order_whatever_order_the_ctas_run(lib, monkeypatch):
    for seed in range(4):
        monkeypatch.setenv("CUATTN_INTERP_BLOCK_SEED", str(seed))
        total, expected = ordered_reduce(lib, "ok")
        np.testing.assert_array_equal(total, expected, err_msg=f"block seed {seed}")


@pytest.mark.parametrize(
    "bug, match",
    [
        ("early reuse", r"source of a bulk reduce .* changed before cp.async.bulk.wait_group.read"),
        ("early release", r"semaphore released while this thread's bulk reduces may still be"),
        ("no fence", r"a bulk reduce reads shared-memory offset \d+, written by plain stores"),
        ("wrong order", r"semaphore wait that no block started before it can satisfy"),
    ],
)
def test_reduce_misuse_fails_the_launch(lib, bug, match):
    with pytest.raises(RuntimeError, match=match):
        ordered_reduce(lib, bug)


def test_work_taken_by_block_index_deadlocks_when_the_ctas_start_out_of_order(lib, monkeypatch):
    """A GPU starts CTAs in no promised order: ranks from blockIdx wait on CTAs not yet running.
    In index order the same kernel passes; the interpreter reports the wait instead of hanging."""
    total, expected = ordered_reduce(lib, "block index")
    np.testing.assert_array_equal(total, expected)
    monkeypatch.setenv("CUATTN_INTERP_BLOCK_SEED", "1")
    with pytest.raises(RuntimeError, match=r"waits for the semaphore at \d+ to hold \d+; it holds"):
        ordered_reduce(lib, "block index")


def test_the_reduce_and_semaphore_ptx_assembles_for_sm_90a():
    """The GPU side, which the interpreter never compiles: the SASS holds the bulk reduce."""
    opcodes, log = sm90a_opcodes(EXPRESSIONS[:1], SOURCE)
    assert "UBLKRED" in opcodes[EXPRESSIONS[0]], (opcodes, log)
