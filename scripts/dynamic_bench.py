"""Dynamic-sparsity benchmark: choosing blocks from the data, then attending on them.

Per sequence length T: the time of cuattn.dynamic.topk_blocks, mass_threshold_blocks and
vertical_slash_layout (pooling or scores, the choice, the CSR/CSC and vertical-slash's bit tables
all on the device: a DeviceLayout, no host round trip; a vertical-slash layout whose tables would
pass the device limit is refused and the table says so), then
forward and forward+backward of cuattn.sparse_attention on the chosen layout and on dense causal
(the rate of the chosen layout's computed blocks over dense causal's, issue 53's measure: 1.0
when time follows the active blocks), of FlexAttention
with a BlockMask built from the same choice (compiled; `flex_mask_build_ms` is what building
that BlockMask on the host costs a step), and of dense causal SDPA. One sequence, 16 heads,
head dim 128, bf16, blocks of 64; top-k keeps TOPK blocks per query block.

    PYTHONPATH=. python scripts/dynamic_bench.py [--quick] [--markdown FILE]    # on a GPU
    python scripts/dynamic_bench.py --smoke      # CPU, tiny: the choice on the kernel interpreter
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cuattn  # noqa: E402
from cuattn import dynamic  # noqa: E402
from cuattn.tools.bench.report import report_rows  # noqa: E402
from cuattn.tools.bench.timing import median_ms  # noqa: E402

HEADS, HEAD_DIM, BLOCK, TOPK, TAU = 16, 128, 64, 16, 0.9
VSLASH = 64  # vertical-slash: columns, offsets and last queries (MInference's defaults)
FULL = (8192, 16384, 32768, 65536, 131072)
QUICK = (8192, 16384)
SMOKE = (256,)
REPEATS = 10


def _fwd_bwd(attend, q, k, v):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    attend(*leaves).float().sum().backward()


def run(n, args, device, dtype, sync):
    gen = torch.Generator(device=device).manual_seed(n)
    q, k, v = (
        torch.randn(1, HEADS, n, HEAD_DIM, device=device, dtype=dtype, generator=gen)
        for _ in range(3)
    )
    block = args.block
    row = {"T": n}
    backend = args.select_backend
    row["topk_select_ms"] = median_ms(
        lambda: dynamic.topk_blocks(q, k, block, TOPK, backend=backend), sync, args.repeats
    )
    row["mass_select_ms"] = median_ms(
        lambda: dynamic.mass_threshold_blocks(q, k, block, TAU, backend=backend),
        sync,
        args.repeats,
    )
    try:
        row["vslash_select_ms"] = median_ms(
            lambda: dynamic.vertical_slash_layout(
                q, k, block, VSLASH, VSLASH, VSLASH, backend=backend
            ),
            sync,
            args.repeats,
        )
    except ValueError as err:  # its bit tables would exceed the device limit: say so
        row["vslash_select_ms"] = f"refused ({str(err).split(';')[0].split(', up to ')[-1]})"
    layout = dynamic.topk_blocks(q, k, block, TOPK, backend=backend)
    row["density"] = layout.density

    def ours(a, b, c):
        return cuattn.sparse_attention(a, b, c, layout)

    row["cuattn_fwd_ms"] = median_ms(lambda: ours(q, k, v), sync, args.repeats)
    row["cuattn_fwd_bwd_ms"] = median_ms(lambda: _fwd_bwd(ours, q, k, v), sync, args.repeats)

    causal = cuattn.make_layout("all", n, HEADS, block, causal=True)

    def ours_causal(a, b, c):
        return cuattn.sparse_attention(a, b, c, causal)

    row["cuattn_causal_fwd_ms"] = median_ms(lambda: ours_causal(q, k, v), sync, args.repeats)
    row["cuattn_causal_fwd_bwd_ms"] = median_ms(
        lambda: _fwd_bwd(ours_causal, q, k, v), sync, args.repeats
    )
    # computed blocks per ms over dense causal's (the same FLOP per block): 1.0 = its rate
    blocks = float(layout.host().nnz.sum()) / float(causal.nnz.sum())
    for step in ("fwd", "fwd_bwd"):
        speedup = row[f"cuattn_causal_{step}_ms"] / row[f"cuattn_{step}_ms"]
        row[f"{step}_rate_vs_causal"] = round(blocks * speedup, 3)

    def sdpa(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=True)

    row["sdpa_causal_fwd_ms"] = median_ms(lambda: sdpa(q, k, v), sync, args.repeats)
    row["sdpa_causal_fwd_bwd_ms"] = median_ms(lambda: _fwd_bwd(sdpa, q, k, v), sync, args.repeats)
    if args.flex:
        from torch.nn.attention.flex_attention import flex_attention

        from cuattn.tools.bench.flex_mask import block_mask_from_layout

        mask = block_mask_from_layout(layout, device)
        row["flex_mask_build_ms"] = median_ms(
            lambda: block_mask_from_layout(layout.host(), device), sync, args.repeats
        )
        flex = torch.compile(flex_attention)

        def flexed(a, b, c):
            return flex(a, b, c, block_mask=mask)

        row["flex_fwd_ms"] = median_ms(lambda: flexed(q, k, v), sync, args.repeats)
        row["flex_fwd_bwd_ms"] = median_ms(lambda: _fwd_bwd(flexed, q, k, v), sync, args.repeats)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny, float32, no Flex")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    if args.smoke:
        device, dtype, lengths = "cpu", torch.float32, SMOKE
        args.block, args.repeats, args.flex, args.select_backend = 32, 2, False, "interp"

        def sync():
            return None
    else:
        device, dtype = "cuda", torch.bfloat16
        lengths = QUICK if args.quick else FULL
        args.block, args.repeats, args.flex, args.select_backend = BLOCK, REPEATS, True, None
        sync = torch.cuda.synchronize
    report_rows((run(n, args, device, dtype, sync) for n in lengths), args.markdown)


if __name__ == "__main__":
    main()
