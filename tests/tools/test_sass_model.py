"""The static SASS model (cuattn/tools/sass*.py).

Parsing and loop attribution on hand-written SASS and on a tiny kernel of our own; the source
regions the attribution excludes; the roofline against the f532ccd profile; and the hot
instantiations against the committed baseline: a test fails when one's instructions or LDSM per
HMMA grow more than 10 % over bench/results/static-baseline-sm90.json, or when one spills.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest

from dev import sass, sass_model, sass_roofline

BASELINE = Path(__file__).resolve().parents[2] / "bench" / "results" / "static-baseline-sm90.json"
# The hot instantiations the CI test compiles (about 2 s each); `python -m dev sass --check`
# covers all.
CI_HOT_SET = (
    "fwd d128 b64",
    "fwd d128 b128",
    "fwd d64 b64",
    "fwd d64 b128",
    "dkdv d128 b64",
    "dq d128 b64",
)

# A counted loop (R2 = 0, 1, 2, 3) with an out-of-line divergence fallback that jumps back into
# it, a predicated exit, and the self-branch padding ptxas puts after the last EXIT.
HAND_SASS = r"""
	.headerflags	@"EF_CUDA_SM90"
//--------------------- .text._Z4tinyPfi --------------------------
	.section	.text._Z4tinyPfi,"ax",@progbits
_Z4tinyPfi:
	//## File "/src/tiny.cu", line 3
        /*0000*/                   MOV R2, RZ ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/               @P1 EXIT ;
.L_x_0:
	//## File "/src/common/inner.cuh", line 7 inlined at "/src/tiny.cu", line 5
	//## File "/src/tiny.cu", line 5
        /*0030*/                   LDSM.16.M88.4 R4, [R0] ;
        /*0040*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0050*/              @!PT LDS RZ, [RZ] ;
	//## File "/src/tiny.cu", line 4
        /*0060*/                   VIADD R2, R2, 0x1 ;
        /*0070*/                   ISETP.GE.AND P0, PT, R2, 0x4, PT ;
        /*0080*/                   BRA.DIV UR4, `(.L_x_2) ;
.L_x_1:
        /*0090*/              @!P0 BRA `(.L_x_0) ;
        /*00a0*/                   EXIT ;
.L_x_2:
        /*00b0*/                   WARPSYNC 0xffffffff ;
        /*00c0*/                   BRA `(.L_x_1) ;
.L_x_3:
        /*00d0*/                   BRA `(.L_x_3) ;
"""

TINY_KERNEL = r"""
__global__ void tiny(const float* __restrict__ x, float* __restrict__ y, int n) {
  float acc = 0.f;
#pragma unroll 1
  for (int i = 0; i < 48; i += 3) acc += x[i * 32 + threadIdx.x] * 2.f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) acc += x[j];
  y[threadIdx.x] = acc;
}
"""

TINY_SOURCE = """\
template <int N>
__device__ void mask_tile(float (&s)[N]) {
  for (int j = 0; j < N; ++j) s[j] = 0.f;
}
__device__ int narrowed(int c) {
  if (c == 0) return 0;
  return cover(c,
               1);
}
__global__ void k(int use_it, float* y) {
  if (use_it) {
    y[0] = 1.f;
  }
  for (int i = tid; i < 8; i += 64) y[i] = 0.f;
  mask_tile<4>(y);
}
"""


def test_parse_instructions_chains_and_labels():
    kernel = sass.parse(HAND_SASS)["_Z4tinyPfi"]
    assert [i.address for i in kernel.instructions][:3] == [0x00, 0x10, 0x20]
    ldsm = kernel.instructions[3]
    assert ldsm.opcode == "LDSM.16.M88.4" and ldsm.klass == "LDSM"
    assert [str(level) for level in ldsm.source] == ["inner.cuh:7", "tiny.cu:5"]
    assert ldsm.in_lines("tiny.cu", 5, 5) and not ldsm.in_lines("tiny.cu", 6, 9)
    assert kernel.instructions[5].never_executes and kernel.instructions[5].klass == "LDS/STS"
    assert kernel.labels[".L_x_0"] == 0x30 and kernel.labels[".L_x_3"] == 0xD0
    assert [str(s) for s in kernel.instructions[6].source] == ["tiny.cu:4"]
    branch = kernel.instructions[9]
    assert (branch.predicate, branch.target) == ("@!P0", ".L_x_0")


def test_loops_follow_the_converged_path_only():
    kernel = sass.parse(HAND_SASS)["_Z4tinyPfi"]
    # one loop: the divergence fallback's jump back and the padding self-branch are no loops
    assert len(kernel.loops) == 1
    loop = kernel.loops[0]
    addresses = sorted(i.address for i in kernel.block_instructions(loop.blocks))
    assert addresses == [0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90]
    assert sass.counted_trips(kernel, loop) == 4
    unreachable = {0xB0, 0xC0, 0xD0}
    reached = {i.address for i in kernel.block_instructions(kernel.reachable)}
    assert not unreachable & reached


def test_instruction_classes_and_wavefront_rules():
    assert sass.instruction_class("HMMA.16816.F32.BF16") == "HMMA"
    assert sass.instruction_class("LDGSTS.E.BYPASS.128") == "LDGSTS"
    assert sass.instruction_class("BAR.SYNC.DEFER_BLOCKING") == "BAR"
    assert sass.instruction_class("UIADD3") == "uniform"
    assert sass.instruction_class("S2UR") == "uniform"
    assert sass.instruction_class("FFMA.FTZ") == "FP32"
    assert sass.instruction_class("IMAD.MOV.U32") == "INT"
    assert sass.instruction_class("BSSY") == "control"
    assert sass.instruction_class("SHFL.BFLY") == "other"
    assert sass.shared_load_wavefronts("LDSM.16.M88.4") == 4
    assert sass.shared_load_wavefronts("LDSM.16.MT88.2") == 2
    assert sass.shared_load_wavefronts("LDS.128") == 4
    assert sass.shared_load_wavefronts("LDS.64") == 2
    assert sass.shared_load_wavefronts("LDS") == 1
    assert sass.shared_load_wavefronts("HMMA.16816.F32") == 0
    assert sass.shared_store_wavefronts("LDGSTS.E.BYPASS.128") == 4
    assert sass.shared_store_wavefronts("STS.64") == 2


def test_cubin_missing_its_last_byte_is_completed():
    header = bytearray(0x40)
    header[:4] = b"\x7fELF"
    header[0x20:0x28] = (0x40).to_bytes(8, "little")  # program headers right after
    header[0x36:0x38] = (56).to_bytes(2, "little")
    header[0x38:0x3A] = (2).to_bytes(2, "little")
    image = bytes(header) + b"\x01" * (2 * 56 - 1)
    assert len(sass.complete_elf(image)) == 0x40 + 2 * 56
    assert sass.complete_elf(b"not an elf") == b"not an elf"


def test_source_regions_the_attribution_excludes():
    function = sass_model.ColdRegion("function", "mask_tile")
    assert sass_model.region_lines(TINY_SOURCE, function) == [(2, 4)]
    if_region = sass_model.ColdRegion("if", "use_it", partial=False)
    assert sass_model.region_lines(TINY_SOURCE, if_region) == [(11, 13)]
    statement = sass_model.ColdRegion("statement", "narrowed", r"return\s+cover")
    assert sass_model.region_lines(TINY_SOURCE, statement) == [(7, 8)]
    assert sass_model.region_lines(TINY_SOURCE, sass_model.STEP_ROW_LOOP) == [(14, 14)]


def test_causal_tiles_follow_the_walk():
    # two 64-blocks, 64-row CTAs, 64-key tiles: block 0 sees its diagonal, block 1 one full tile
    # and its diagonal
    assert sass_roofline.causal_tiles(128, 64, 64, 64, own_is_query=True) == (2, 3, 2)
    # 32-key tiles: the diagonal block's second sub-tile is partial for the 64-row CTA
    assert sass_roofline.causal_tiles(64, 64, 64, 32, own_is_query=True) == (1, 2, 2)
    # keys own: the same pairs seen from the columns
    assert sass_roofline.causal_tiles(128, 64, 64, 64, own_is_query=False) == (2, 3, 2)
    # 32-row CTAs over 32-row steps: a key tile past the first query sub-tile skips it
    ctas, tiles, partial = sass_roofline.causal_tiles(64, 64, 32, 32, own_is_query=False)
    assert (ctas, tiles, partial) == (2, 3, 2)


def test_paired_causal_tiles_read_each_union_step_once():
    # five 64-blocks: pairs (0, 1), (2, 3) and (4) alone; the unions hold 2, 4 and 5 key tiles;
    # the blocks' own rows 1 + 2 + 3 + 4 + 5 tiles, of which the 5 diagonals are partial
    assert sass_roofline.paired_causal_tiles(5 * 64, 64, 64) == (3, 11, 15, 5)


def test_roofline_reproduces_sdpa_flash_from_its_profile():
    csv_path = sass_roofline.PROFILE_DIR / sass_roofline.PROFILE_CSV
    if not csv_path.exists():
        pytest.skip(f"{csv_path} is not in this checkout")
    profile = sass_roofline.read_profile(csv_path)
    assert set(profile) == {"fwd", "dkdv", "dq", "fa2 fwd", "fa2 bwd"}
    assert profile["fwd"].instructions == 457_383_936
    for label in ("fa2 fwd", "fa2 bwd"):
        work = sass_roofline.fa2_work(label, profile[label])
        # the tensor peak read off the profile: 2/3 HMMA per SM cycle
        active = sass_roofline.PROFILE_ACTIVE_CYCLES[label] * profile[label].tensor_pct / 100
        assert work.hmma / sass_roofline.SMS / active == pytest.approx(2 / 3, rel=0.01)
        predicted = sass_roofline.predict_seconds(work)
        assert abs(predicted / profile[label].seconds - 1) < 0.25, label
    rows = sass_roofline.fa2_reference_rows(profile)
    assert [round(r["per_hmma"], 1) for r in rows] == [4.9, 3.5]


def test_regressions_name_growth_and_spills():
    spec = sass_model.HotSpec(
        "fwd x", "fwd", "attn_fwd.cu", "attn_fwd<...>", 64, 0, 128, 2, 64, 64, 32, 128
    )
    per_tile = dict.fromkeys(sass.CLASSES, 0.0)
    per_tile["HMMA"], per_tile["INT"], per_tile["LDSM"] = 128.0, 1000.0, 48.0
    model = sass_model.TileModel(
        spec, 200, 0, 4, 8, per_tile, {}, {}, 128.0, 48.0, 192.0, 64.0, 2.0, 0.0, 1
    )
    entry = sass_model.baseline_entry(model)
    baseline = {"instantiations": {"fwd x": entry}}
    assert sass_model.regressions([model], baseline, 0.10) == []
    model.per_tile["INT"] = 1200.0  # 8.8 -> 10.4 instructions per HMMA
    model.ldsm = 60.0
    model.spill_bytes = 16
    problems = sass_model.regressions([model], baseline, 0.10)
    assert len(problems) == 3
    assert any("instructions_per_hmma" in p for p in problems)
    assert any("ldsm_per_hmma" in p for p in problems)
    assert any("16 bytes of spills" in p for p in problems)


def _tools_or_skip() -> None:
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    problem = sass_model.missing_tools()
    if problem is not None:
        pytest.skip(f"static SASS model unavailable: {problem}")


def test_tiny_kernel_loops_and_counted_trips():
    _tools_or_skip()
    from cuattn.backends.toolchain import common_options

    lowered, cubin, _ = sass_model.compile_cubin(
        TINY_KERNEL, "tiny.cu", "tiny", common_options(with_kernel_dir=False)
    )
    with tempfile.TemporaryDirectory() as workdir:
        kernel = sass.parse(sass.disassemble(cubin, Path(workdir)))[lowered]
    loops = list(sass.walk_loops(kernel.loops))
    trips = sorted(t for t in (sass.counted_trips(kernel, loop) for loop in loops) if t is not None)
    assert trips == [16]  # 0, 3, ..., 45; the threadIdx-strided loop is not counted
    assert len(loops) >= 2
    counted = next(loop for loop in loops if sass.counted_trips(kernel, loop) == 16)
    body = kernel.block_instructions(counted.blocks)
    assert any(i.base == "LDG" for i in body)
    assert all(level.file == "tiny.cu" for i in body for level in i.source)


def test_hot_instantiations_stay_within_the_baseline():
    _tools_or_skip()
    from cuattn.backends.toolchain import common_options, kernel_dir

    baseline = json.loads(BASELINE.read_text())
    specs = [s for s in sass_model.hot_specs() if s.label in CI_HOT_SET]
    assert {s.label for s in specs} == set(CI_HOT_SET)
    assert set(CI_HOT_SET) <= set(baseline["instantiations"])
    models = sass_model.model_specs(
        specs, sass_model.current_sources(specs), common_options(), kernel_dir()
    )
    problems = sass_model.regressions(models, baseline, sass_model.REGRESSION_TOLERANCE)
    assert not problems, "\n".join(problems) + (
        f"\n(a deliberate change: python -m dev sass --write-baseline {BASELINE.name}, with the "
        "reason in bench/NOTES.md)"
    )
    for model in models:
        # the attribution found exactly one tile of the expected mma count per iteration
        assert model.hmma == model.spec.hmma_per_warp_tile
        assert model.local_accesses == 0


@pytest.mark.slow
def test_model_reproduces_the_f532ccd_profile():
    """f532ccd rebuilt from git: instructions and shared wavefronts within 15 % of ncu, time
    within 25 % (the calibration table of bench/results/2026-11-25-static-sm90.md)."""
    _tools_or_skip()
    if not (sass_roofline.PROFILE_DIR / sass_roofline.PROFILE_CSV).exists():
        pytest.skip("the f532ccd profile is not in this checkout")
    try:
        calibration = sass_roofline.calibrate(jobs=1, labels=("d128",))
    except (OSError, RuntimeError) as exc:  # no git, or no f532ccd in a shallow clone
        pytest.skip(f"f532ccd's kernels cannot be rebuilt here: {exc}")
    for row in calibration.rows:
        if row["ours"]:
            assert abs(row["instructions"] / row["ncu_instructions"] - 1) < 0.15, row
            assert abs(row["ld_wavefronts"] / row["ncu_ld_wavefronts"] - 1) < 0.15, row
        assert abs(row["seconds"] / row["ncu_seconds"] - 1) < 0.25, row


@pytest.mark.slow
def test_model_predicts_the_h200_counters_out_of_sample():
    """e6a0613 rebuilt from git against the H200 run's counters, which nothing in the model was
    fitted on: shared wavefronts within 2 %, instructions within 20 % (dK/dV: +14-16 %), the
    backward's times within 15 %. The forward's time is not held to anything: the model is
    28-41 % optimistic for the paired forward there (bench/NOTES.md, "The static model out of
    sample"), a gap this test records rather than hides."""
    _tools_or_skip()
    logs = sass_roofline.VALIDATION_LOGS.values()
    if not all((sass_roofline.VALIDATION_DIR / log).exists() for log in logs):
        pytest.skip("the H200 counters are not in this checkout")
    try:
        rows = sass_roofline.validate(jobs=1)
    except (OSError, RuntimeError) as exc:  # no git, or no e6a0613 in a shallow clone
        pytest.skip(f"e6a0613's kernels cannot be rebuilt here: {exc}")
    ours = [r for r in rows if r["ours"]]
    assert len(ours) == 6
    for row in ours:
        assert abs(row["ld_wavefronts"] / row["ncu_ld_wavefronts"] - 1) < 0.02, row
        assert abs(row["instructions"] / row["ncu_instructions"] - 1) < 0.20, row
        if not row["kernel"].startswith("fwd"):
            assert abs(row["seconds"] / row["ncu_seconds"] - 1) < 0.15, row
    assert 1.8 < sass_roofline.backward_wavefront_ratio(rows, 128) < 2.1


def test_dev_sass_prints_the_report_and_checks_the_baseline(tmp_path, capsys):
    _tools_or_skip()
    from dev.__main__ import main

    out = tmp_path / "report.md"
    args = ["sass", "--filter", "dq d128 b64", "--jobs", "1", "--markdown", str(out)]
    assert main([*args, "--check", str(BASELINE)]) == 0
    printed = capsys.readouterr().out
    row = "| dq d128 b64 `attn_bwd_dq<64, 64, 32, 128, __nv_bfloat16, MASK_CAUSAL, MODS_NONE>`"
    assert row in printed
    assert "## Hot instantiations" in out.read_text()


ELSE_SOURCE = """\
__global__ void k(int coverage, float* y) {
  if (coverage != TILE_EMPTY) {
    y[0] = 1.f;
  } else {
    y[0] = 0.f;
  }
  if (coverage != TILE_FULL) y[1] = 2.f;
}
"""


def test_else_region_and_hgmma_shapes():
    skipped = sass_model.ColdRegion("else", "TILE_EMPTY", skipped=True)
    assert sass_model.region_lines(ELSE_SOURCE, skipped) == [(4, 6)]
    assert skipped.bucket == sass_model.SKIPPED
    assert sass_model.region_lines(ELSE_SOURCE, sass_model.ColdRegion("else", "TILE_FULL")) == []
    assert sass.instruction_class("HGMMA.64x128x16.F32.BF16") == "HGMMA"
    assert sass.hgmma_shape("HGMMA.64x128x16.F32.BF16") == (64, 128, 16)
    assert sass.hgmma_flop("HGMMA.64x128x16.F32.BF16") == 2 * 16 * 128 * 16
    assert sass.hgmma_flop("HMMA.16816.F32.BF16") == 0
    # A in registers: a warp reads a quarter of B (128 x 16 bf16); both from descriptors: a
    # quarter of A and of B
    rs = sass.Instruction(0, "HGMMA.64x128x16.F32.BF16", "R24, R220, gdesc[UR16].tnspB, R24")
    ss = sass.Instruction(0, "HGMMA.64x64x16.F32.BF16", "R152, gdesc[UR16].tnspA.tnspB, RZ, !UPT")
    assert sass.hgmma_shared_bytes(rs) == 128 * 16 * 2 // 4
    assert sass.hgmma_shared_bytes(ss) == (64 + 64) * 16 * 2 // 4


def test_sm90_backward_steps_of_a_causal_layout():
    # 256 tokens, 128-blocks: key tile 0 walks 4 steps, tile 1 two; on each tile's diagonal
    # step the upper consumer's keys lie past every query (skipped) and the lower one is
    # masked; the upper one is masked on the next step
    steps = sass_roofline.sm90_backward_steps(256, 128)
    assert steps == sass_roofline.Sm90BackwardSteps(2, 6, 10, 4, 2)
    # paired 64-blocks walk the union of the two columns: the same steps
    assert sass_roofline.sm90_backward_steps(256, 64) == steps
    # every step is walked by both consumers, computed or skipped
    big = sass_roofline.sm90_backward_steps(4096, 128)
    assert big.computed + big.skipped == 2 * big.steps == 2 * 1056


def test_sm90a_backward_attribution_finds_a_step_of_hgmma():
    """The static model on kernels/attn_bwd_sm90.cu (sm_90a): the main loop is the consumers'
    step loop with one step of HGMMA (S^T, dP^T d/16 each, dV, dK 4 each, dQ_part 8), the
    skipping consumer's path apart (dQ_part over the other consumer's half alone: 4), the
    producer's two step loops found, no spills; and the whole kernel's HGMMA at the quick shape
    as the model counts it (its computing partner's dQ_part over its own half alone, once a
    CTA, is not in the model's step: bench/NOTES.md, the dQ GEMM over the halves, landed)."""
    _tools_or_skip()
    from cuattn.backends.toolchain import common_options, kernel_dir

    specs = [
        s for s in sass_model.hot_specs() if s.kind == sass_model.SM90_BWD_KIND and s.block == 128
    ]
    assert {s.head_dim for s in specs} == {64, 128}
    models = sass_model.model_specs(
        specs, sass_model.current_sources(specs), common_options(), kernel_dir()
    )
    for model in models:
        d = model.spec.head_dim
        assert model.hmma == {64: 24, 128: 32}[d] == model.spec.hmma_per_warp_tile
        assert model.tiles_per_iteration == 1
        assert model.skipped["HGMMA"] == 4
        # 8 consumer warps: the step's 5 GEMMs of 64 queries x 128 keys x d
        assert model.wgmma_flop * 8 == 5 * 2 * 64 * 128 * d
        assert model.spill_bytes == 0 and model.local_accesses == 0
        assert model.producer["uniform"] > 0  # UTMALDG and UBLKRED are uniform instructions
        assert (model.ctas_per_sm, model.warps_per_sm) == (1, 12)
    d128 = next(m for m in models if m.spec.head_dim == 128)
    # the kernel's own count: 2 x 67,584 - 2048 consumer steps computed at 32 a warp, the 2048
    # skipped ones' 4 a warp matched by their partners' 4 fewer (dQ_part over one half)
    assert sass_roofline.sm90_backward_hgmma(d128, sass_roofline.PROFILE_SHAPE) == 17_039_360
    work = sass_roofline.kernel_work(d128, sass_roofline.PROFILE_SHAPE)
    # 67,584 steps: 2 x 67,584 - 2048 consumer steps computed (5 GEMMs of 64 x 64 x 128); in
    # the 2048 diagonal ones the upper consumers skip, both consumers compute dQ_part over the
    # lower one's 64 keys: half a GEMM each, one computed step's FLOP a pair
    gemm = 2 * 64 * 64 * 128
    assert work.wgmma_flop == (2 * 67_584 - 2048) * 5 * gemm


def test_sm90a_persistent_backward_counts_its_items_apart():
    """attn_bwd_sm90_persistent (d128, 128-blocks): the step loop is found inside the item loop
    (a step of HGMMA, the same step code as attn_bwd_sm90's within 5 %), the code of the item
    loop is per item for the consumers and the producer, only the rest per CTA; its roofline
    charges a CTA's code once an SM and an item's once an item, so over dense causal it issues
    fewer instructions than the one-shot kernel and the same HGMMA."""
    _tools_or_skip()
    from cuattn.backends.toolchain import common_options, kernel_dir

    labels = ("bwd sm90a d128 b128", "bwd sm90a persistent d128 b128")
    specs = [s for s in sass_model.hot_specs() if s.label in labels]
    assert [s.kind for s in specs] == list(sass_model.SM90_BWD_KINDS)
    one_shot, persistent = sass_model.model_specs(
        specs, sass_model.current_sources(specs), common_options(), kernel_dir()
    )
    assert persistent.hmma == 32 == persistent.spec.hmma_per_warp_tile
    assert persistent.skipped["HGMMA"] == 4
    assert abs(persistent.instructions / one_shot.instructions - 1) < 0.05
    assert persistent.spill_bytes == 0
    assert (persistent.ctas_per_sm, persistent.warps_per_sm) == (1, 12)
    # the item: the consumers' dK/dV epilogue and set-up, the producer's claim and K/V copies
    assert persistent.per_item["HGMMA"] == 0 and sum(persistent.per_item.values()) > 0
    assert persistent.producer_item["uniform"] > 0  # UTMALDG of K and V, once an item
    assert not one_shot.per_item and not one_shot.producer_item
    assert sum(persistent.per_cta.values()) < sum(one_shot.per_cta.values()) / 2
    shape = sass_roofline.PROFILE_SHAPE
    work = {m.spec.kind: sass_roofline.kernel_work(m, shape) for m in (one_shot, persistent)}
    fast, slow = work[sass_model.SM90_BWD_PERSISTENT_KIND], work[sass_model.SM90_BWD_KIND]
    assert fast.instructions < slow.instructions
    assert fast.wgmma_flop == slow.wgmma_flop and fast.l2_bytes == slow.l2_bytes
    assert sass_roofline.sm90_backward_hgmma(persistent, shape) == 17_039_360
    cycles = sass_roofline.sm90_backward_step_cycles(persistent)
    assert 0 < cycles.cta < cycles.item < sass_roofline.sm90_backward_step_cycles(one_shot).cta


def test_sm90_forward_tiles_of_a_causal_layout():
    # 256 tokens, 128-blocks, 128-key tiles: item 0 walks its diagonal tile, item 1 a full
    # tile and its diagonal; both consumers compute every tile, masked on the diagonals
    tiles = sass_roofline.sm90_forward_tiles(256, 128, 128)
    assert tiles == sass_roofline.Sm90ForwardTiles(2, 3, 6, 4, 0)
    # paired 64-blocks, 64-key tiles: an item walks the union of its two rows (2 and 4 tiles);
    # the first consumer skips its pair's second block, the second computes every tile
    paired = sass_roofline.sm90_forward_tiles(256, 64, 64)
    assert paired == sass_roofline.Sm90ForwardTiles(2, 6, 10, 4, 2)
    # every step is walked by both consumers, computed or skipped; at T = 4096 a head's CTAs t
    # compute 2t + 1 and 2t + 2 tiles (bench/NOTES.md, the 510d8d7 run: 2080 a head)
    big = sass_roofline.sm90_forward_tiles(4096, 64, 64)
    assert big.computed + big.skipped == 2 * big.steps
    assert big.computed == 2080 and big.skipped == 32
    # DRAM, by default: q, k, v read and out written once (bf16), lse written once
    shape = sass_roofline.PROFILE_SHAPE
    elements = 64 * 4096 * 128
    assert sass_roofline.sm90_forward_compulsory_dram(shape) == 4 * 2 * elements + 64 * 4096 * 4


@functools.cache
def _sm90_forward_models() -> dict[str, sass_model.TileModel]:
    """The paired 64-block attn_fwd_sm90 (skipped tiles, the profiled instantiation) and the
    128-block persistent one (the item loop), d128, compiled once for the tests below."""
    from cuattn.backends.toolchain import common_options, kernel_dir

    labels = ("fwd sm90a d128 b64", "fwd sm90a persistent d128 b128")
    specs = [s for s in sass_model.hot_specs() if s.label in labels]
    assert {s.label for s in specs} == set(labels)
    models = sass_model.model_specs(
        specs, sass_model.current_sources(specs), common_options(), kernel_dir()
    )
    return {m.spec.label: m for m in models}


def test_sm90a_forward_attribution_finds_a_tile_of_hgmma():
    """kernels/attn_fwd_sm90.cu (sm_90a): the tile is a consumer warp's QK^T (d / 16 wgmma
    m64nTILE_Nk16, Q and K from shared memory) and PV (TILE_N / 16 m64ndk16, P in registers),
    its softmax's exp2 and two rescale exp2 on MUFU; the skipped tile issues the previous
    tile's PV; the producer copies K and V a step as d / 64 boxes each; no spills, no ptxas
    warnings, and the counts within the committed baseline."""
    _tools_or_skip()
    models = _sm90_forward_models()
    for model in models.values():
        spec = model.spec
        d, tile_n = spec.head_dim, spec.tile_n
        assert model.hmma == d // 16 + tile_n // 16 == spec.hmma_per_warp_tile
        # 4 warps a consumer: 64 rows x tile_n keys x d, twice (QK^T, PV)
        assert model.wgmma_flop * 4 == 2 * (2 * 64 * tile_n * d)
        # a quarter of Q and K for each QK^T step, of V for each PV step
        assert model.wgmma_shared_bytes == (d * (tile_n + 64) + tile_n * d) * 2 // 4
        assert model.per_tile["MUFU"] == tile_n // 2 + 2
        assert model.skipped["HGMMA"] == tile_n // 16
        assert model.producer["UTMALDG"] == 2 * d // 64
        assert model.spill_bytes == 0 and model.local_accesses == 0
        assert not model.ptxas_warnings
        assert (model.ctas_per_sm, model.warps_per_sm) == (1, 12)
    persistent = models["fwd sm90a persistent d128 b128"]
    assert persistent.per_item["HGMMA"] == 8  # a consumer's last PV, after its tile loop
    assert sum(persistent.producer_item.values()) > 0  # claim, publish, Q's copies
    baseline = json.loads(BASELINE.read_text())
    problems = sass_model.regressions(
        list(models.values()), baseline, sass_model.REGRESSION_TOLERANCE
    )
    assert not problems, "\n".join(problems)


def test_sm90a_forward_whole_kernel_hgmma_from_the_layout():
    """The whole kernel's HGMMA at the profiled shape (dense causal T = 4096, batch 4, 16 heads
    of d128) is the static count per warp per tile times the layout's computed tiles times 4
    warps; at 64-blocks it is ncu's count of the 510d8d7 run. The roofline's FLOP add up to
    the computed tiles' GEMMs."""
    _tools_or_skip()
    models = _sm90_forward_models()
    shape = sass_roofline.PROFILE_SHAPE
    for model in models.values():
        spec = model.spec
        tiles = sass_roofline.sm90_forward_tiles(shape.n_ctx, spec.block, spec.tile_n)
        computed = tiles.computed * shape.pairs
        hgmma = sass_roofline.sm90_forward_hgmma(model, shape)
        assert hgmma == 4 * computed * model.hmma
        work = sass_roofline.kernel_work(model, shape)
        assert work.wgmma_flop == computed * 2 * (2 * 64 * spec.tile_n * spec.head_dim)
    paired = models["fwd sm90a d128 b64"]
    assert sass_roofline.sm90_forward_hgmma(paired, shape) == 6_389_760
    assert sass_roofline.SM90_FORWARD_MEASURED_HGMMA["fwd sm90a d128 b64"] == 6_389_760
    wide = models["fwd sm90a persistent d128 b128"]
    assert sass_roofline.sm90_forward_hgmma(wide, shape) == 64 * 1056 * 4 * 16


@pytest.mark.slow
def test_model_counts_the_510d8d7_forward_out_of_sample():
    """510d8d7's attn_fwd_sm90 rebuilt from git against that H200 run's counters, which nothing
    in the model was fitted on: HGMMA exact, instructions within 5 % (+2.1 / +3.4 %), MUFU within
    2 % of the XU pipe. The time is not held to them: the roofline is 28-42 % optimistic for the
    64-block forward (bench/NOTES.md, "The static model judges the sm_90a forward"), a gap this
    test records rather than hides."""
    _tools_or_skip()
    logs = sass_roofline.SM90_FORWARD_LOGS.values()
    if not all((sass_roofline.SM90_FORWARD_DIR / log).exists() for log in logs):
        pytest.skip("the 510d8d7 counters are not in this checkout")
    try:
        rows = sass_roofline.validate_sm90_forward(jobs=1)
    except (OSError, RuntimeError) as exc:  # no git, or no 510d8d7 in a shallow clone
        pytest.skip(f"510d8d7's kernels cannot be rebuilt here: {exc}")
    assert len(rows) == 2
    for row in rows:
        assert row["hgmma"] == row["ncu_hgmma"], row
        assert abs(row["instructions"] / row["ncu_instructions"] - 1) < 0.05, row
        assert abs(row["mufu"] / row["ncu_xu"] - 1) < 0.02, row
        assert row["seconds"] < row["ncu_seconds"], row
