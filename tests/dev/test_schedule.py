"""dev/schedule.py, the schedule simulator: the CTA lists it builds from a layout, the list
scheduler's bounds, monotonic sanity on nested layouts, and the committed calibration table
recomputed from the committed GPU sweep (no GPU timing here)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from cuattn.backends import geometry
from cuattn.layout import Layout, make_layout
from dev import calibrate_schedule, schedule

HEAD_DIM = 128
FITTED = schedule.load_fitted()


def _causal(n_ctx: int, block: int, heads: int = 2) -> object:
    return make_layout("all", n_ctx=n_ctx, heads=heads, blocksize=block, causal=True)


def test_paired_causal_ctas():
    """Dense causal at 64-blocks: CTA t of a pair walks key tiles 0 .. 2t + 1 and its two
    consumers compute 2t + 1 and 2t + 2 of them (NOTES, the HGMMA count that matched ncu)."""
    layout, batch = _causal(1024, 64), 3
    ctas = schedule.fwd_sm90_ctas(layout, batch, HEAD_DIM)
    tiles = 1024 // 128
    assert len(ctas) == tiles * 2 * batch
    per_tile = schedule.wgmma_cycles(64, 64, HEAD_DIM)
    assert per_tile == 512  # 8 m64n64k16 + 4 m64n128k16 at N / 2 cycles each
    for c in ctas:
        assert c.walked == 2 * c.tile + 2
        assert c.tensor_cycles == (4 * c.tile + 3) * per_tile
        assert c.masked == 2  # each consumer's diagonal block
        assert c.reads == tuple((c.pair, k) for k in range(2 * c.tile + 2))
    # heads fastest: every pair's last tile first
    assert [c.tile for c in ctas[: 2 * batch]] == [tiles - 1] * 2 * batch
    assert {c.pair for c in ctas[: 2 * batch]} == set(range(2 * batch))


def test_wide_tiles_cover_block_pairs():
    """128-key tiles at 64-blocks walk a tile where either of its two key blocks is active and
    compute it whole (twice a 64-key tile's tensor cycles)."""
    layout = _causal(1024, 64, heads=1)
    narrow = schedule.fwd_sm90_ctas(layout, 1, HEAD_DIM)
    wide = schedule.fwd_sm90_ctas(layout, 1, HEAD_DIM, tile_n=128)
    for n, w in zip(narrow, wide, strict=True):
        assert w.walked == n.tile + 1 == n.walked // 2
        assert w.tensor_cycles == 2 * (w.tile + 1) * schedule.wgmma_cycles(64, 128, HEAD_DIM)
        assert w.tensor_cycles >= n.tensor_cycles


def test_gqa_shares_kv_reads():
    layout = _causal(512, 64, heads=4)
    ctas = schedule.fwd_sm90_ctas(layout, 1, HEAD_DIM, kv_group=2)
    assert {c.reads[0][0] for c in ctas} == {0, 1}


def test_list_schedule_bounds():
    rng = np.random.default_rng(0)
    for slots in (1, 4, 132):
        durations = rng.uniform(1, 100, size=500).tolist()
        makespan, starts = schedule.list_schedule(durations, slots)
        lower = max(sum(durations) / slots, max(durations))
        assert lower <= makespan <= sum(durations) / slots + max(durations) + 1e-9
        assert starts[:slots] == [0.0] * min(slots, len(durations))
    assert schedule.list_schedule([5.0] * 264, 132)[0] == 10.0


def test_more_blocks_never_less_time():
    """Nested layouts never predict less time: local windows of growing width (one element
    rule), and block sets without an element rule that only gain blocks (the list scheduler
    in the kernel's fixed order, L2 misses included). A causal layout may take longer than the
    dense one at one wave: its longest row is a dense row plus the masking of its diagonal."""
    for block in (64, 128):
        times = []
        for window in (128, 256, 512, 1024, 2048):
            layout = make_layout(
                "local", n_ctx=2048, heads=4, blocksize=block, causal=True, local_attn_ctx=window
            )
            times.append(schedule.predict_fwd(layout, 2, HEAD_DIM, FITTED[0]).seconds)
        assert times == sorted(times), (block, times)
    rng = np.random.default_rng(1)
    blocks = np.zeros((4, 64, 64), dtype=bool)
    times = []
    for _ in range(6):
        blocks |= rng.random(blocks.shape) < 0.08
        layout = Layout.from_blocks(blocks.astype(np.int8), 64)
        times.append(schedule.predict_fwd(layout, 2, HEAD_DIM, FITTED[0]).seconds)
    assert times == sorted(times), times


def test_persistent_without_hiding_is_not_faster_than_its_work():
    layout, batch = _causal(2048, 64, 8), 4  # 512 CTAs: several waves, no row alone bounds it
    today = schedule.predict_fwd(layout, batch, HEAD_DIM, FITTED[0])
    same = schedule.predict_persistent(layout, batch, HEAD_DIM, FITTED[0], item_share=1.0)
    assert same.balanced_cycles == pytest.approx(today.balanced_cycles, rel=0.05)
    assert same.makespan_cycles >= same.balanced_cycles
    hidden = schedule.predict_persistent(layout, batch, HEAD_DIM, FITTED[0], item_share=0.5)
    assert hidden.seconds < same.seconds


def test_the_built_persistent_list_is_today_s_ctas_and_a_counter_beats_a_stride():
    """predict_built_persistent schedules geometry.sm90_work_list's items: today's CTAs, all of
    them; on a causal layout claiming the next item beats a fixed stride over the list, which
    hands CTA 0 the longest item of every round."""
    layout, batch = _causal(4096, 64, 8), 4  # 1024 items on 132 slots
    today = schedule.predict_fwd(layout, batch, HEAD_DIM, FITTED[0])
    built = schedule.predict_built_persistent(layout, batch, HEAD_DIM, FITTED[0], 1.0)
    assert built.ctas == today.ctas
    assert built.tile_cycles == pytest.approx(today.tile_cycles)
    stride = schedule.predict_built_persistent(layout, batch, HEAD_DIM, FITTED[0], 0.5, stride=True)
    counter = schedule.predict_built_persistent(layout, batch, HEAD_DIM, FITTED[0], 0.5)
    assert counter.seconds < stride.seconds
    assert counter.seconds < today.seconds


def test_the_built_split_keeps_the_work_and_removes_the_global_rows_tail():
    """BigBird's global rows split by geometry's threshold: the same tiles and tensor work in
    more entries (the chunks), the tail much shorter, a faster prediction with the merge included; a
    layout with no split row (and as many items as SMs or more) predicts the same either way."""
    bigbird = make_layout("bigbird", n_ctx=4096, heads=4, blocksize=64, causal=False)
    batch = 2
    whole = schedule.predict_built_persistent(bigbird, batch, HEAD_DIM, FITTED[0], 0.5)
    split = schedule.predict_built_persistent(
        bigbird, batch, HEAD_DIM, FITTED[0], 0.5, split_tiles=None
    )
    assert split.ctas > whole.ctas
    work = geometry.sm90_work_list(bigbird.blocks, batch, 4096, HEAD_DIM, "bfloat16", 1, 64)
    assert split.ctas == len(work.items) and len(work.merges) == batch * 4
    assert split.tile_cycles == pytest.approx(whole.tile_cycles, rel=0.01)
    assert split.tail < 0.6 * whole.tail and split.seconds < 0.7 * whole.seconds
    assert schedule.merge_seconds(FITTED[0], work, HEAD_DIM) > FITTED[0].launch_us * 1e-6
    causal = _causal(2048, 64, 8)  # 256 items: no few-items split either
    assert schedule.predict_built_persistent(
        causal, batch, HEAD_DIM, FITTED[0], 0.5, split_tiles=None
    ) == schedule.predict_built_persistent(causal, batch, HEAD_DIM, FITTED[0], 0.5)


def test_the_packing_threshold_keeps_enough_items_a_slot():
    """pack_threshold: the largest candidate whose packed list keeps PACK_MIN_ITEMS_PER_SLOT
    items a CTA; none where packing even the shortest rows would leave fewer."""
    items = [schedule.Cta(pair, tile, 2, 1.0, 0, ()) for pair in range(4) for tile in range(64)]
    slots = 4
    below = schedule.pack_threshold(items, slots, 0)
    assert below in schedule.PACK_CANDIDATES
    assert len(schedule.work_list(items, below, None)) >= schedule.PACK_MIN_ITEMS_PER_SLOT * slots
    larger = [c for c in schedule.PACK_CANDIDATES if c > below]
    for candidate in larger:
        packed = schedule.work_list(items, candidate, None)
        assert len(packed) < schedule.PACK_MIN_ITEMS_PER_SLOT * slots
    assert schedule.pack_threshold(items, 64, 0) == 0  # 256 items: fewer than 8 a slot already


def test_work_list_packs_and_splits():
    layout = make_layout("bigbird", n_ctx=2048, heads=2, blocksize=64, causal=False)
    ctas = schedule.fwd_sm90_ctas(layout, 1, HEAD_DIM)
    items = schedule.work_list(ctas, pack_below=8, split_above=16)
    assert sum(i.walked for i in items) == sum(c.walked for c in ctas)
    assert sum(i.tensor_cycles for i in items) == pytest.approx(sum(c.tensor_cycles for c in ctas))
    assert max(i.walked for i in items) <= 16 + 8
    assert sum(i.items for i in items) >= len(ctas)
    lengths = [i.tensor_cycles + i.walked for i in items]
    assert lengths == sorted(lengths, reverse=True)


def test_fwd_params_change_what_they_scale():
    layout = _causal(1024, 64)
    base = schedule.predict_fwd(layout, 1, HEAD_DIM, FITTED[0])
    slower = dataclasses.replace(FITTED[0], cta_cycles=FITTED[0].cta_cycles * 2)
    assert schedule.predict_fwd(layout, 1, HEAD_DIM, slower).seconds > base.seconds


@pytest.mark.parametrize("label", ["strided", "bigbird", "variable", "document"])
def test_committed_calibration_reproduces(label):
    """The committed table's rows of a few held-out patterns, recomputed from the committed sweep
    and constants; the summary recomputed from the committed rows."""
    data = json.loads(calibrate_schedule.CALIBRATION_JSON.read_text())
    rows = [r for r in calibrate_schedule.load_rows() if r.label == label]
    committed = {e["name"]: e for e in data["rows"]}
    terms = calibrate_schedule.row_terms(rows)
    for row in rows:
        entry = committed[row.name]
        assert entry["measured_ms"] == pytest.approx(row.measured_s * 1e3, abs=1e-4)
        predicted = calibrate_schedule.predict(row, terms[calibrate_schedule._case(row)], *FITTED)
        assert entry["predicted_ms"] == pytest.approx(predicted * 1e3, abs=2e-4)
        assert entry["side"] == ("fit" if row.fit else "held out")
    assert calibrate_schedule.summary(data["rows"]) == data["summary"]


def test_the_sm90a_backward_s_items_are_its_ctas_in_claim_order():
    """Dense causal at 64-blocks, 2 heads x 2 batches: one item per (128-key tile, kv head,
    batch), claimed group by group (geometry.sm90_backward_cta_groups), position-major over
    the descending tiles (kernels.backward_tile_order); tile j walks T / 64 - 2j steps, of which
    the first (query block 2j, which the pair's second block lacks) one consumer computes."""
    n_ctx, batch = 1024, 2
    layout = _causal(n_ctx, 64)
    items = schedule.bwd_sm90_items(layout, batch, HEAD_DIM)
    tiles = n_ctx // 128
    assert len(items) == tiles * 2 * batch
    groups = geometry.sm90_backward_cta_groups(batch, 2, n_ctx, HEAD_DIM, "bfloat16", 1)
    per_group = 2 * batch // groups
    assert [i.tile for i in items[:per_group]] == [tiles - 1] * per_group
    for item in items:
        steps = item.steps
        assert [q for _, q, _ in steps] == list(range(2 * item.tile, n_ctx // 64))
        assert [held for _, _, held in steps] == [1] + [2] * (len(steps) - 1)
        assert {pair for pair, _, _ in steps} == {item.kv_pair}


def test_the_sm90a_backward_s_schedules_keep_their_bounds():
    """The simulated makespan is never under the balanced time; the unordered dQ never slower
    than the ordered; a persistent grid paying half the fixed latency is faster on a thin
    layout; split columns shorten bigbird's tail (and its chunks cover the column's steps)."""
    # 256 items, more than the SMs
    strided = make_layout("strided", n_ctx=2048, heads=4, blocksize=64, local_attn_ctx=128)
    bigbird = make_layout("bigbird", n_ctx=2048, heads=4, blocksize=64)
    for layout in (strided, bigbird):
        ordered = schedule.predict_bwd_sm90(layout, 4, HEAD_DIM)
        unordered = schedule.predict_bwd_sm90(layout, 4, HEAD_DIM, ordered=False)
        assert ordered.makespan_cycles >= ordered.balanced_cycles
        assert unordered.seconds <= ordered.seconds
    today = schedule.predict_bwd_sm90(strided, 4, HEAD_DIM)
    persistent = schedule.predict_bwd_sm90(strided, 4, HEAD_DIM, persistent_share=0.5)
    assert persistent.seconds < today.seconds
    assert persistent.fixed_cycles < today.fixed_cycles
    items = schedule.bwd_sm90_items(bigbird, 4, HEAD_DIM)
    split, above = schedule.split_bwd_items(items, schedule.SM90_BWD_SPLIT_FACTOR, 8)
    assert above and len(split) > len(items)
    assert max(len(i.steps) for i in split) <= above
    assert sorted(s for i in split for s in i.steps) == sorted(s for i in items for s in i.steps)
    unsplit = schedule.predict_bwd_sm90(bigbird, 4, HEAD_DIM, persistent_share=0.5)
    chunked = schedule.predict_bwd_sm90(bigbird, 4, HEAD_DIM, persistent_share=0.5, split=True)
    assert chunked.tail < unsplit.tail


def test_the_table_prints_each_lever():
    shape = schedule.BenchShape(n_ctx=1024, heads=2, batch=1, head_dim=HEAD_DIM)
    table = schedule.bwd_sm90_table(shape, blocks=(128,), labels=("strided",))
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[2:]] == ["| strided, 128"]  # over dense causal's
    # pattern, density, steps, today, unordered, then each lever but today: a pipe each and one
    assert all(r.count("|") == 5 + len(schedule.SM90_BWD_LEVERS) for r in rows)


def test_the_backward_s_step_cycles_are_the_static_model_s():
    """SM90_BWD_STEP_CYCLES are dev/sass_roofline.sm90_backward_step_cycles of the kernel as
    committed (d128, 128-blocks recompiled here: within 1 %)."""
    from cuattn.backends.toolchain import common_options, kernel_dir
    from dev import sass_model, sass_roofline

    if sass_model.missing_tools() is not None:
        pytest.skip("no SASS tools")
    (spec,) = [s for s in sass_model.hot_specs() if s.label == "bwd sm90a d128 b128"]
    (model,) = sass_model.model_specs(
        [spec], sass_model.current_sources([spec]), common_options(), kernel_dir()
    )
    cycles = sass_roofline.sm90_backward_step_cycles(model)
    expected = schedule.SM90_BWD_STEP_CYCLES[(128, 128)]
    got = (cycles.full, cycles.half, cycles.cta)
    assert got == pytest.approx(expected, rel=0.01)
