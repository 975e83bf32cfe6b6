"""The benchmark harness, exercised end to end on the CPU (NumPy backend, perf_counter)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import cuattn
from cuattn.backends.call import AttentionCall
from cuattn.tools.bench import report as bench_report
from cuattn.tools.bench import run as bench
from cuattn.tools.bench import runners as bench_runners
from cuattn.tools.bench.cases import FULL, QUICK, SWEEPS, BenchCase
from cuattn.tools.bench.runners import InputSet
from cuattn.tools.bench.timing import input_sets_needed


def test_dry_run_writes_json_markdown_and_plot(tmp_path, capsys):
    assert bench.main(["--dry-run", "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("*.json")
    report = json.loads(json_path.read_text())
    assert report["all_correct"] and report["records"]
    labels = {r["case"]["pattern"]["label"] for r in report["records"]}
    assert labels == {p.label for p in SWEEPS["dry-run"].patterns}
    for record in report["records"]:
        ours = record["results"][report["ours"]]
        assert ours["median_ms"] > 0 and ours["tflops"] > 0
        assert set(record["skipped"]) == {"sdpa-flash", "sdpa-cudnn", "flex"}
        assert "time_vs_dense_causal" in record
    table = json_path.with_suffix(".md").read_text()
    assert table.count("\n| ") == len(report["records"]) + 1
    assert "no CUDA device" in table
    pytest.importorskip("matplotlib")
    assert json_path.with_suffix(".png").stat().st_size > 0
    assert "[1/" in capsys.readouterr().err  # progress as it goes


def test_flops_count_only_computed_blocks():
    case = next(iter(SWEEPS["dry-run"].cases()))
    layout = case.pattern.make_layout(case.n_ctx, case.heads, case.blocksize)
    nb = layout.num_blocks
    causal_blocks = case.heads * nb * (nb + 1) // 2
    per_block = 4 * case.blocksize**2 * case.head_dim
    assert bench.case_flops(case, layout) == per_block * causal_blocks * case.batch
    backward = BenchCase(**{**case.__dict__, "direction": "fwd+bwd"})
    assert bench.case_flops(backward, layout) == 3.5 * per_block * causal_blocks * case.batch


def test_sweeps_cover_the_issue():
    full = list(FULL.cases())
    dense = [c for c in full if c.pattern.dense]
    assert {c.n_ctx for c in dense} == {2048, 8192, 16384}
    assert {c.head_dim for c in dense} == {64, 128}
    assert {c.pattern.label for c in dense} == {"dense-causal", "dense"}
    assert {c.dtype for c in full} == {"bfloat16"}
    assert {c.direction for c in full} == {"fwd", "fwd+bwd"}
    modes = {c.pattern.mode for c in full}
    assert modes == set(cuattn.MODES)  # every registered pattern
    assert {c.pattern.causal for c in full if c.pattern.mode != "all"} == {True, False}
    sparse = [c for c in full if not c.pattern.dense]
    assert {(c.n_ctx, c.head_dim) for c in sparse} == {(8192, 128)}
    # every sparse pattern in both directions, once
    assert len(sparse) == 2 * len({c.pattern.label for c in sparse}) == 30
    gqa = [c for c in full if c.kv != c.heads]
    assert {(c.pattern.label, c.n_ctx, c.head_dim, c.heads // c.kv) for c in gqa} == {
        ("dense-causal", 8192, 128, 4)
    }
    assert full[0].head_dim == 128  # the headline cases first, should the budget cut the run
    assert len(list(QUICK.cases())) < len(full)


def test_dense_causal_comes_first_in_each_problem():
    seen: set[tuple] = set()
    for case in FULL.cases():
        if case.pattern.label == "dense-causal":
            seen.add(case.problem_key)
        else:
            assert case.problem_key in seen


def test_density_ratio_target():
    records = [
        {
            "case": {"pattern": {"label": "dense-causal"}},
            "problem_key": [1],
            "density_vs_causal": 1.0,
            "results": {"me": {"median_ms": 10.0}},
        },
        {
            "case": {"pattern": {"label": "local"}},
            "problem_key": [1],
            "density_vs_causal": 0.25,
            "results": {"me": {"median_ms": 3.0}},
        },
    ]
    bench_report.add_density_ratios(records, "me")
    assert records[1]["time_vs_dense_causal"] == pytest.approx(0.3)
    assert records[1]["density_target_met"] is False  # 0.3 > 1.15 * 0.25


def test_rotation_exceeds_cache():
    assert input_sets_needed(1 << 30) == 1
    assert 2 <= input_sets_needed(16 << 20) <= 8


def _torch_problem(case: BenchCase):
    torch = pytest.importorskip("torch")
    layout = case.pattern.make_layout(case.n_ctx, case.heads, case.blocksize)
    gen = torch.Generator().manual_seed(0)
    shape = (case.batch, case.heads, case.n_ctx, case.head_dim)
    tensors = [torch.randn(shape, dtype=torch.float64, generator=gen) for _ in range(4)]
    return layout, [InputSet(*tensors)]


@pytest.mark.filterwarnings("ignore::UserWarning")  # eager FlexAttention warns it is unfused
@pytest.mark.parametrize("direction", ["fwd", "fwd+bwd"])
def test_peer_runners_compute_the_same_attention(monkeypatch, direction):
    """SdpaRunner (math backend, the one CPUs have) and FlexRunner (eager here: compiling on CPU
    takes minutes; forward only) against the NumPy reference, outputs and gradients."""
    from torch.nn.attention.flex_attention import flex_attention

    from cuattn.backends import numpy_ref as reference

    monkeypatch.setattr(bench_runners, "_compiled_flex", lambda: flex_attention)
    base = next(c for c in SWEEPS["dry-run"].cases() if c.pattern.mode == "local")
    dense = next(c for c in SWEEPS["dry-run"].cases() if c.pattern.label == "dense-causal")
    scale = 0.25
    pairs = [(bench_runners.SdpaRunner("MATH"), dense)]
    if direction == "fwd":  # FlexAttention has no backward on the CPU
        pairs.append((bench_runners.FlexRunner(), base))
    for runner, case in pairs:
        case = BenchCase(**{**case.__dict__, "direction": direction})
        layout, inputs = _torch_problem(case)
        got = runner.prepare(case, layout, inputs, scale)(0)
        q, k, v, dout = (x.numpy() for x in (inputs[0].q, inputs[0].k, inputs[0].v, inputs[0].dout))
        out, lse = reference.attention_forward(q, k, v, AttentionCall(layout, scale))
        if direction == "fwd":
            np.testing.assert_allclose(got.detach().numpy(), out, atol=1e-10)
        else:
            want = reference.attention_backward(
                q, k, v, out, lse, dout, None, AttentionCall(layout, scale)
            )
            for g, w in zip(got, want, strict=True):
                np.testing.assert_allclose(g.numpy(), w, atol=1e-10)


def test_sdpa_skips_sparse_cases_with_a_reason():
    case = next(c for c in SWEEPS["dry-run"].cases() if not c.pattern.dense)
    with pytest.raises(bench_runners.Skip, match="dense cases only"):
        bench_runners.SdpaRunner("FLASH_ATTENTION").prepare(case, None, [], 1.0)


def test_warm_up_names_only_real_instantiations():
    from cuattn.backends.geometry import all_instantiations

    known = {(f, n) for f, names in all_instantiations().items() for n in names}
    units = bench.kernel_units_for(list(FULL.cases()))
    assert units and set(units) <= known
    names = [n for _, n in units]
    assert "attn_bwd_dkdv<64, 64, 32, 1, 128, __nv_bfloat16, MASK_BITMASK, MODS_NONE>" in names
    assert "attn_bwd_dq<64, 64, 32, 128, __nv_bfloat16, MASK_BITMASK, MODS_NONE>" in names
    assert "attn_fwd<64, 64, 64, 4, 128, __nv_bfloat16, MASK_CAUSAL, MODS_NONE>" in names


@pytest.mark.filterwarnings("ignore::UserWarning")  # eager FlexAttention warns it is unfused
def test_sweep_with_peers_on_cpu(monkeypatch, tmp_path):
    """The GPU sweep's peer path (peer agreement, speedups, targets, report) with CPU stand-ins:
    torch float64 tensors, SDPA's math backend, eager FlexAttention (forward only on CPU)."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention.flex_attention import flex_attention

    from cuattn.backends import resolve_backend
    from cuattn.tools.bench.cases import DRY_RUN, Sweep
    from cuattn.tools.bench.timing import CpuTimer

    monkeypatch.setattr(bench_runners, "_compiled_flex", lambda: flex_attention)
    monkeypatch.setitem(bench.TOLERANCE, "float64", 1e-10)

    class TorchCpuEnvironment(bench.Environment):
        def make_inputs(self, case, count, shape):
            return [InputSet(*(torch.randn(shape, dtype=torch.float64) for _ in range(4)))]

    ours = bench_runners.CuattnRunner(resolve_backend("numpy", False), lambda t: t.numpy())
    peers = [bench_runners.SdpaRunner("MATH"), bench_runners.FlexRunner()]
    env = TorchCpuEnvironment(False, "cpu-torch", CpuTimer(), ours, peers, None, 0, 2)
    sweep = Sweep(**{**DRY_RUN.__dict__, "dtypes": ("float64",), "directions": ("fwd",)})
    report = bench.run_sweep(env, sweep, budget_s=120)
    assert report["all_correct"] and len(report["records"]) == len(list(sweep.cases()))
    for record in report["records"]:
        assert "flex" in record["speedup"] and record["peer_rel_error"]["flex"] < 1e-10
        if record["case"]["pattern"]["mode"] == "all":
            assert record["peer_rel_error"]["sdpa-math"] < 1e-10
        else:
            assert "dense cases only" in record["skipped"]["sdpa-math"]
    report["mode"] = "test"
    paths = bench.write_results(report, tmp_path, "-test")
    table = paths[1].read_text()
    assert "x flex" in table and "compiled FlexAttention:" in table
    assert "not measured" in table  # no SDPA-flash on a CPU: that target says so


def test_a_failing_peer_is_reported_and_the_sweep_goes_on():
    """On an H100, FlexAttention's compile ran out of shared memory on one case and the
    exception ended the whole sweep; a peer's failure must cost that peer that case only."""
    from cuattn.backends import resolve_backend
    from cuattn.tools.bench.timing import CpuTimer

    class Broken:
        name = "broken"

        def prepare(self, case, layout, inputs, scale):
            raise RuntimeError("No valid triton configs.\nOutOfMemoryError: out of resource")

    ours = bench_runners.CuattnRunner(resolve_backend("numpy", False), lambda x: x)
    env = bench.Environment(False, "cpu", CpuTimer(), ours, [Broken()], None, 0, 1)
    report = bench.run_sweep(env, SWEEPS["dry-run"], budget_s=120)
    assert len(report["records"]) == len(list(SWEEPS["dry-run"].cases()))
    for record in report["records"]:
        reason = record["skipped"]["broken"]
        assert reason.startswith(record["name"] + ": failed: RuntimeError: No valid triton")
        assert "\n" not in reason and "broken" not in record["speedup"]


def test_head_dims_replace_the_sweep_s_and_a_wrong_one_is_refused(tmp_path):
    args = ["--dry-run", "--out", str(tmp_path), "--patterns", "dense-causal"]
    assert bench.main([*args, "--head-dims", "16"]) == 0
    (json_path,) = tmp_path.glob("*.json")
    records = json.loads(json_path.read_text())["records"]
    assert records and {r["case"]["head_dim"] for r in records} == {16}
    for wrong in ("12", "64,x", "-64"):
        with pytest.raises(SystemExit, match=f"--head-dims: got '{wrong}', expected .* of 16, 32"):
            bench.main([*args, "--head-dims", wrong])
