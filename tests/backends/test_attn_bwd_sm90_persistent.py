"""The persistent sm_90a backward (kernels/attn_bwd_sm90.cu, attn_bwd_sm90_persistent; opt-in by
CUATTN_BWD_SM90=persistent) through the CPU interpreter: dQ, dK and dV against the float64 oracle
and bit-equal to the one-shot attn_bwd_sm90 (both run the same CTA code over the same items in
the same claim order) on dense causal, a thin strided layout, bigbird with a ragged tail, GQA over
two batches and a key block nobody attends (dK = dV = 0); the same bits with one CTA taking every
item (the interpreter runs one CTA at a time: the least residency there is, the place slots and
barrier phases wrapping many times) or more CTAs than items, in shuffled block orders; ranks that
do not follow the claim order reported as a deadlock, not hung. The GPU side that needs no GPU:
NVRTC compiles its instantiations for sm_90a with no spills and unserialised wgmma."""

from __future__ import annotations

import numpy as np
import pytest

from cuattn.backends import geometry, interp
from cuattn.backends.call import AttentionCall
from cuattn.layout.registry import make_layout
from tests.backends.test_attn_bwd_sm90 import (
    check_sm90a_build,
    claim_longest_ranks_shortest,
    order_case,
)
from tests.backends.test_interp_kernels import HEADS, TOLERANCE, make_test_layout, n_ctx_for
from tests.backends.test_sm90a_family import inputs, launched
from tests.helpers.oracle import dense_attention_grads, rel_err

pytest.importorskip("ml_dtypes")

DTYPE = "bfloat16"
HEAD_DIM = 64


@pytest.fixture
def sm90a(monkeypatch):
    monkeypatch.setenv(geometry.KERNELS_ENV, "sm90a")


def persistent_and_one_shot(monkeypatch, layout, q, k, v, out, lse, dout, call):
    """(persistent grads, their kernel names, the one-shot kernel's grads)."""
    monkeypatch.setenv(geometry.BWD_SM90_ENV, geometry.BWD_SM90_ONE_SHOT)
    one_shot, names = launched(interp.backward, q, k, v, out, lse, dout, None, call)
    assert names[1].startswith("attn_bwd_sm90<"), names
    monkeypatch.setenv(geometry.BWD_SM90_ENV, geometry.BWD_SM90_PERSISTENT)
    grads, names = launched(interp.backward, q, k, v, out, lse, dout, None, call)
    return grads, names, one_shot


def oracle(layout, q, k, v, dout, scale):
    """The float64 gradients, dK and dV summed over each kv head's query heads."""
    batch, kv_heads = k.shape[:2]
    group = layout.heads // kv_heads
    k_full, v_full = (np.repeat(x, group, axis=1) for x in (k, v))
    refs = dense_attention_grads(q, k_full, v_full, dout, layout.to_mask(), scale)
    return (refs[0], *(r.reshape(batch, kv_heads, group, *r.shape[2:]).sum(2) for r in refs[1:]))


def assert_same_bits(grads, others, what: str) -> None:
    for name, grad, other in zip("qkv", grads, others, strict=True):
        np.testing.assert_array_equal(
            grad.view(np.uint16), other.view(np.uint16), err_msg=f"d{name}, {what}"
        )


# (label, layout, batch, kv heads): dense causal at 128-blocks; strided at 64-blocks (3-6
# blocks a column, pairs whose other block lacks a step); bigbird over 350 keys (a ragged last
# block, global columns far longer than the rest); "none"'s test layout, whose head 1 key block 1
# nobody attends (with 64-blocks one consumer skips every step: dK = dV = 0 there). GQA: below.
CASES = [
    ("dense-causal", lambda: make_test_layout("causal", 128, n_ctx_for(128)), 1, HEADS),
    ("strided", lambda: make_layout("strided", 384, HEADS, 64, local_attn_ctx=16), 1, HEADS),
    ("bigbird-ragged", lambda: make_layout("bigbird", 350, HEADS, 64, causal=False), 1, HEADS),
    ("empty-column", lambda: make_test_layout("none", 64, n_ctx_for(64)), 1, HEADS),
]


@pytest.mark.parametrize("label, make, batch, kv_heads", CASES, ids=[c[0] for c in CASES])
def test_persistent_matches_the_oracle_and_the_one_shot_kernel_bit_for_bit(
    sm90a, monkeypatch, label, make, batch, kv_heads
):
    layout = make()
    q, k, v, dout = inputs(layout, batch, kv_heads, HEAD_DIM, DTYPE, seed=11)
    scale = HEAD_DIM**-0.5
    call = AttentionCall(layout, scale)
    out, lse = interp.forward(q, k, v, call)
    grads, names, one_shot = persistent_and_one_shot(
        monkeypatch, layout, q, k, v, out, lse, dout, call
    )
    cxx = geometry.CXX_TYPE[DTYPE]
    rule = geometry.CXX_RULE[layout.rule.kind]
    assert names[1] == (
        f"attn_bwd_sm90_persistent<{layout.blocksize}, {geometry.SM90_BWD_TILE_Q}, {HEAD_DIM}, "
        f"{cxx}, {rule}>"
    )
    for name, grad, ref in zip("qkv", grads, oracle(layout, q, k, v, dout, scale), strict=True):
        assert grad.shape == ref.shape and grad.dtype == q.dtype, f"d{name}"
        assert not np.isnan(grad.astype(np.float32)).any(), f"d{name} left poisoned"
        assert rel_err(grad, ref) <= TOLERANCE[DTYPE], f"d{name} against the oracle"
    assert_same_bits(grads, one_shot, "against attn_bwd_sm90")
    if label == "empty-column":
        assert not layout.blocks[1, :, 1].any()
        for grad in grads[1:]:
            assert (grad[:, 1, 64:128] == 0).all()
            assert np.abs(grad[:, 1, :64].astype(np.float32)).max() > 0


def test_any_cta_count_and_block_order_gives_the_same_bits(sm90a, monkeypatch):
    """GQA (4 query heads on 2 kv heads, 2 batches, causal: an item loops over its kv head's
    query heads): one CTA taking all 8 items (the place slots and every barrier's phases wrap),
    or more CTAs than items (the rest find the counter past the last) in a shuffled block order;
    the one-shot kernel's bits, and the oracle's gradients."""
    from cuattn.backends import kernels

    layout = make_layout("all", 3 * 64, 4, 64, causal=True)
    q, k, v, dout = inputs(layout, 2, 2, HEAD_DIM, DTYPE, seed=13)
    call = AttentionCall(layout, 0.125)
    out, lse = interp.forward(q, k, v, call)
    one_shot = interp.backward(q, k, v, out, lse, dout, None, call)
    monkeypatch.setenv(geometry.BWD_SM90_ENV, geometry.BWD_SM90_PERSISTENT)
    grids = []
    launch = interp.launch

    def spy(config, **values):
        if config.kernel == geometry.SM90_BWD_PERSISTENT:
            grids.append(config.grid)
        return launch(config, **values)

    monkeypatch.setattr(interp, "launch", spy)
    for ctas, seed in ((1, "0"), (64, "5")):
        monkeypatch.setattr(kernels.KernelBackend, "multiprocessors", lambda self, x, n=ctas: n)
        monkeypatch.setenv("CUATTN_INTERP_BLOCK_SEED", seed)
        grads = interp.backward(q, k, v, out, lse, dout, None, call)
        assert_same_bits(grads, one_shot, f"{ctas} CTAs, block seed {seed}")
    items = 2 * 2 * 2  # key tiles (two 64-blocks each) x kv heads x batch
    assert grids == [(1, 1, 1), (items, 1, 1)]
    for name, grad, ref in zip("qkv", grads, oracle(layout, q, k, v, dout, 0.125), strict=True):
        assert not np.isnan(grad.astype(np.float32)).any(), f"d{name} left poisoned"
        assert rel_err(grad, ref) <= TOLERANCE[DTYPE], f"d{name} against the oracle"


def test_ranks_that_do_not_follow_the_claim_order_are_reported_not_hung(sm90a, monkeypatch):
    """Caught: items claimed longest column first while the dQ ranks still put the shortest
    first; the one CTA that takes every item waits, at its first reduce, for a rank no item
    claimed before it holds, and the interpreter reports the deadlock instead of hanging."""
    claim_longest_ranks_shortest(monkeypatch)
    monkeypatch.setenv(geometry.BWD_SM90_ENV, geometry.BWD_SM90_PERSISTENT)
    layout, q, k, v, dout, out, lse = order_case()
    with pytest.raises(RuntimeError, match=r"waits for the semaphore at \d+ to hold \d+"):
        interp.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, 0.125))


def test_the_schedule_is_one_shot_unless_asked_and_a_bad_one_is_refused(sm90a, monkeypatch):
    layout = make_test_layout("causal", 128, n_ctx_for(128))
    q, k, v, dout = inputs(layout, 1, HEADS, HEAD_DIM, DTYPE, seed=2)
    call = AttentionCall(layout, 0.125)
    out, lse = interp.forward(q, k, v, call)
    monkeypatch.delenv(geometry.BWD_SM90_ENV, raising=False)
    _, names = launched(interp.backward, q, k, v, out, lse, dout, None, call)
    assert names[1].startswith("attn_bwd_sm90<"), names
    monkeypatch.setenv(geometry.BWD_SM90_ENV, "looping")
    launches = []
    monkeypatch.setattr(interp, "launch", lambda config, **values: launches.append(config))
    with pytest.raises(ValueError, match="CUATTN_BWD_SM90='looping'.*one-shot, persistent"):
        interp.backward(q, k, v, out, lse, dout, None, call)
    assert launches == []


def test_its_instantiations_compile_for_sm_90a_without_spills_or_serialised_wgmma():
    """NVRTC compiles the persistent backward for sm_90a where registers are tightest, d = 128
    (the producer has 24, the consumers none to spare), bf16: the 64-block causal rule and the
    128-block bitmask and window rules (`python -m dev compile` builds all 56): no spills, ptxas
    neither injects waits between wgmma (C7519) nor serialises them (C7520, C7512), and each
    kernel holds one step's HGMMA (the item loop adds none), the TMA loads, the bulk reduce and
    setmaxnreg."""
    configs = [
        c
        for c in geometry.sm90_backward_configs(geometry.SM90_BWD_PERSISTENT)
        if (c.block, c.head_dim, c.dtype, c.rule, c.dq_unordered)
        in (
            (64, 128, DTYPE, "causal", False),
            (128, 128, DTYPE, "bitmask", False),
            (128, 128, DTYPE, "window", False),
        )
    ]
    assert len(configs) == 3
    check_sm90a_build(configs)


def test_where_it_has_no_instantiation_the_one_shot_kernel_runs(sm90a, monkeypatch):
    """d = 128, 64-blocks, the window and bitmask rules (SM90_BWD_PERSISTENT_SPILLS): the switch
    keeps attn_bwd_sm90 there (the launches recorded, not run)."""
    layout = make_test_layout("window", 64, n_ctx_for(64))
    q, k, v, dout = inputs(layout, 1, HEADS, 128, DTYPE, seed=4)
    out, lse = (np.zeros(q.shape, q.dtype), np.zeros(q.shape[:3], np.float32))
    assert (64, 128, "window") in geometry.SM90_BWD_PERSISTENT_SPILLS
    monkeypatch.setenv(geometry.BWD_SM90_ENV, geometry.BWD_SM90_PERSISTENT)
    launches = []
    monkeypatch.setattr(interp, "launch", lambda config, **values: launches.append(config))
    interp.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, 0.125))
    assert [c.kernel for c in launches] == [
        "attn_bwd_preprocess",
        geometry.SM90_BWD,
        geometry.SM90_BWD_DQ,
    ]


def test_a_device_layout_runs_it_on_the_order_built_on_the_device(sm90a, monkeypatch):
    """A DeviceLayout (bigbird causal, a ragged tail, 2 batches): the persistent backward runs on
    the claim order and ranks built on the device (nothing read back to the host), the bits of
    the host layout's one-shot backward."""
    from tests.backends.test_device_schedules import as_device, no_host_schedule

    device = as_device(make_layout("bigbird", 6 * 64 + 5, 2, 64, causal=True))
    host = device.host()
    q, k, v, dout = inputs(host, 2, 2, HEAD_DIM, DTYPE, seed=17)
    call = AttentionCall(host, 0.125)
    out, lse = interp.forward(q, k, v, call)
    one_shot = interp.backward(q, k, v, out, lse, dout, None, call)
    monkeypatch.setenv(geometry.BWD_SM90_ENV, geometry.BWD_SM90_PERSISTENT)
    with no_host_schedule():
        grads, names = launched(
            interp.backward, q, k, v, out, lse, dout, None, AttentionCall(device, 0.125)
        )
    assert names[1:3] == ["sm90_claim_order", "sm90_dq_ranks"], names
    assert names[3].startswith("attn_bwd_sm90_persistent<"), names
    assert_same_bits(grads, one_shot, "device layout against the host's one-shot")
