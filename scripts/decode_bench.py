"""Decode benchmark: cuattn.decode_attention over a paged KVCache, per policy, against SDPA.

For each case (batch, context, policy) a CuPy KVCache is prefilled with random bf16 tokens;
then a decode step (append t_q tokens to every sequence, decode_attention with those t_q
queries; --t-q, default 1: speculative decoding checks more) is
timed end to end (what a serving loop pays: the cache's bookkeeping on the device, Quest's
choice, HeavyHitters' score update) and the decode kernels alone (split + merge). The baseline is
torch's SDPA (enable_gqa) over the same kept tokens laid out contiguously (what a dense cache would
read), FlexAttention over them (contiguous), and FlexAttention's own paged decode over them in
shuffled pages (cuattn/tools/bench/flex_paged.py; it keeps every token: Flex has no eviction), and
where flashinfer imports its batch decode over them in shuffled pages of our page size
(flashinfer_ms; cuattn/tools/bench/flashinfer_paged.py; one query a sequence). For a policy that
chooses pages (Quest) the step is split into its choice, timed alone (choice_ms; `choice` names the
path: quest_select, one kernel, or xp, the array library's operations, as --quest / CUATTN_QUEST
choose on a GPU), and its attention (kernel_ms: the kernels over the pages it chose), beside the
full step's attention over the same cache read whole (full_ms: Quest keeps every token) and their
ratio, quest_x_full = (choice_ms + kernel_ms) / full_ms (issue 52's target at a quarter of the
pages: <= 0.35). GB/s counts the K and V bytes the kernels read: every kept token, or with Quest
every token of each page some query head of a kv group chose.

After the full cache's row come `paged_decode` rows (policy column "paged_decode"): the same
tokens in vLLM's layout (k/v [num_blocks, page, kv_heads, d] in shuffled blocks, an int32
block_table and seq_lens), decoded by cuattn.paged_decode (kernel_ms; no cache bookkeeping, so
step_ms is "-"): in bf16 pages, and with --pages fp8 also in that format (one scale a block), so
that one run holds the fp8 step beside the bf16 one over the same tokens.

    PYTHONPATH=. python scripts/decode_bench.py                 # on a GPU: the full table
    PYTHONPATH=. python scripts/decode_bench.py --quick
    python scripts/decode_bench.py --smoke                      # CPU: tiny, the interpreter
    PYTHONPATH=. python scripts/decode_bench.py --decode gqa    # the tensor-core decode kernel
    PYTHONPATH=. python scripts/decode_bench.py --decode gqa --t-q 4 --page 64 --cases 64x32768
    PYTHONPATH=. python scripts/decode_bench.py --policies quest --quest kernel --cases 64x32768

The `decode` column names the kernel kernel_ms timed (--decode sets CUATTN_DECODE: "split",
the default, or "gqa", attn_decode_gqa wherever it applies; the smoke runs it in bf16).
--pages float8_e4m3fn (or float8_e5m2) keeps the cache in fp8 pages with a scale a page (q and
the tokens stay bf16; it sets CUATTN_DECODE_FP8=kernel), GB/s then counting one byte an element:

    PYTHONPATH=. python scripts/decode_bench.py --pages float8_e4m3fn --cases 64x32768
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cuattn  # noqa: E402
from cuattn import policies  # noqa: E402
from cuattn.backends import geometry, resolve_backend  # noqa: E402
from cuattn.backends.call import AttentionCall  # noqa: E402
from cuattn.serving import decode as decode_module  # noqa: E402
from cuattn.serving import fp8  # noqa: E402
from cuattn.tools.bench.report import report_rows  # noqa: E402
from cuattn.tools.bench.timing import median_ms  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
FULL = [(1, n) for n in (4096, 16384, 65536, 131072)] + [(64, n) for n in (4096, 16384, 32768)]
QUICK = [(1, 4096), (1, 16384), (64, 4096)]
SMOKE = [(1, 96), (2, 64)]
SMOKE_PAGE = 8
PREFILL_CHUNK = 8192  # tokens appended at once while filling a cache
REPEATS = 20
QUEST_XP_CHOICE = "xp"  # the choice column of Quest's array-library path
FLEX_FALLBACK_PAGE = 128  # FlexAttention's default block size


def make_policy(name: str, context: int, page: int):
    quarter = max(context // 4, 1)
    return {
        "full": None,
        "sliding": policies.SlidingWindow(quarter),
        "streaming": policies.StreamingLLM(4, quarter),
        "h2o": policies.HeavyHitters(quarter, max(quarter // 4, 1)),
        "quest": policies.Quest(max(quarter // page, 1), page),
    }[name]


def storage(dtype: str):
    """The array dtype of a cuattn dtype name (bfloat16 through ml_dtypes)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _fill(cache, xp, context, dtype, rng):
    batch = cache.batch
    done = 0
    while done < context:
        t = min(PREFILL_CHUNK, context - done)
        shape = (batch, cache.kv_heads, t, cache.head_dim)
        k = xp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(storage(dtype))
        v = xp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(storage(dtype))
        cache.append(k, v)
        done += t


def run_case(args, batch, context, policy_name, xp, dtype, backend):
    """One row; ``dtype``: the tokens' and q's, and the pages' unless --pages says fp8."""
    rng = np.random.default_rng(0)
    like = xp.zeros(1, dtype=xp.float32) if xp is not np else None
    page = args.page
    policy = make_policy(policy_name, context, page)
    pages = args.pages if args.pages in geometry.KV_DTYPES else dtype
    cache = cuattn.KVCache(
        batch, KV_HEADS, args.head_dim, pages, page_size=page, policy=policy, like=like
    )
    _fill(cache, xp, context, dtype, rng)
    q_shape = (batch, HEADS, args.t_q, args.head_dim)
    q = xp.asarray(rng.standard_normal(q_shape, dtype=np.float32))
    q = q.astype(storage(dtype))
    step_shape = (batch, KV_HEADS, args.t_q, args.head_dim)
    token = xp.asarray(rng.standard_normal(step_shape, np.float32))
    token = token.astype(storage(dtype))
    sync = xp.cuda.Device().synchronize if xp is not np else (lambda: None)

    def step():
        cache.append(token, token)
        cuattn.decode_attention(q, cache, backend=backend)

    step_ms = median_ms(step, sync, args.repeats)
    impl = resolve_backend(backend, on_device=xp is not np)
    kept = int((cache.positions() >= 0).sum())
    read_tokens, chosen = kept, None
    call = AttentionCall(None, args.head_dim**-0.5)
    quest = dict(choice="-", choice_ms="-", full_ms="-", quest_x_full="-")
    if policy is not None and policy.selects_pages:  # the kernels read the pages Quest chose
        tables = cache.device_tables()
        quest["choice"] = (
            geometry.QUEST_SELECT_KERNEL
            if decode_module.quest_kernel_applies(impl, q)
            else QUEST_XP_CHOICE
        )
        quest["choice_ms"] = median_ms(
            lambda: decode_module.quest_chosen(cache, q, *tables, impl=impl), sync, args.repeats
        )
        chosen = decode_module.quest_chosen(cache, q, *tables, impl=impl)
        by_kv_head = chosen.reshape(batch, KV_HEADS, -1, chosen.shape[-1]).any(axis=2)
        read_tokens = int(by_kv_head.sum()) * page
        # Quest keeps every token: the same cache read whole is the full step's attention
        quest["full_ms"] = median_ms(
            lambda: decode_module.kernel_call(impl, cache, q, call), sync, args.repeats
        )
    kernel_ms = median_ms(
        lambda: decode_module.kernel_call(impl, cache, q, call, chosen), sync, args.repeats
    )
    if chosen is not None:
        quest["quest_x_full"] = (quest["choice_ms"] + kernel_ms) / quest["full_ms"]
    itemsize = geometry.ITEMSIZE[pages]
    kv_bytes = 2 * read_tokens * args.head_dim * itemsize
    row = dict(
        batch=batch,
        context=context,
        t_q=args.t_q,
        page=page,
        pages=pages,
        policy=policy_name,
        kept=kept // (batch * KV_HEADS),
        step_ms=step_ms,
        choice=quest["choice"],
        choice_ms=quest["choice_ms"],
        kernel_ms=kernel_ms,
        full_ms=quest["full_ms"],
        quest_x_full=quest["quest_x_full"],
        gbps=kv_bytes / kernel_ms / 1e6,
        decode=decode_kernel(args.head_dim, pages),
    )
    if args.baselines:
        row.update(baselines(cache, q, kept // (batch * KV_HEADS), args, sync))
    if policy is not None:
        return [row]
    paged_dtypes = dict.fromkeys((dtype, pages))  # the tokens' dtype, then the fp8 pages'
    return [
        row,
        *(paged_row(row, cache, q, context, kind, args, sync, backend) for kind in paged_dtypes),
    ]


def vllm_pages(cache, context: int, kind: str, rng):
    """A full ``cache``'s first ``context`` tokens of every sequence in vLLM's layout: (k, v
    [num_blocks, page, kv_heads, d] with the blocks shuffled, block_table int32 [batch, blocks],
    seq_lens int32 [batch], paged_decode's fp8 keywords). ``kind``: the pages' dtype; an fp8 one
    re-quantises the values with a scale a block (a block holds every kv head's tokens)."""
    xp = cache.xp
    page = cache.page_size
    blocks = -(-context // page)
    table = cache.page_table[:, :, :blocks]  # [batch, kv_heads, blocks]: filled in order
    shuffle = xp.asarray(rng.permutation(cache.batch * blocks).astype(np.int32))
    block_table = shuffle.reshape(cache.batch, blocks)
    seq_lens = xp.full(cache.batch, context, dtype=xp.int32)
    out, scales = [], []
    for pages, page_scale in ((cache.k_pages, cache.k_scale), (cache.v_pages, cache.v_scale)):
        values = pages[table]  # [batch, kv_heads, blocks, page, d]
        if page_scale is not None:
            values = fp8.decode(xp, values, cache.dtype) * page_scale[table][..., None, None]
        values = values.transpose(0, 2, 3, 1, 4)  # [batch, blocks, page, kv_heads, d]
        flat = xp.empty((cache.batch * blocks, *values.shape[2:]), dtype=values.dtype)
        flat[shuffle] = values.reshape(-1, *values.shape[2:])
        if kind in geometry.KV_DTYPES:
            used = xp.ones(flat.shape[:2], dtype=bool)
            codes, block_scale = fp8.quantize_pages(
                xp, flat.reshape(*flat.shape[:2], -1).astype(xp.float32), used, kind
            )
            flat, scale = codes.reshape(flat.shape), block_scale
        else:
            flat, scale = flat.astype(storage(kind)), None
        out.append(flat)
        scales.append(scale)
    fp8_keywords = {}
    if kind in geometry.KV_DTYPES:
        fp8_keywords = dict(kv_dtype=kind, k_scale=scales[0], v_scale=scales[1])
    return out[0], out[1], block_table, seq_lens, fp8_keywords


def paged_row(full_row, cache, q, context, kind, args, sync, backend):
    """cuattn.paged_decode over the full cache's tokens in vLLM's layout, pages of ``kind``."""
    k, v, block_table, seq_lens, fp8_keywords = vllm_pages(
        cache, context, kind, np.random.default_rng(1)
    )
    q = q if kind in geometry.KV_DTYPES else q.astype(storage(kind))

    def decode():
        cuattn.paged_decode(q, k, v, block_table, seq_lens, backend=backend, **fp8_keywords)

    kernel_ms = median_ms(decode, sync, args.repeats)
    kv_bytes = 2 * cache.batch * KV_HEADS * context * args.head_dim * geometry.ITEMSIZE[kind]
    row = dict(full_row)  # the same tokens: the same baselines
    row.update(
        pages=kind,
        policy="paged_decode",
        kept=context,
        step_ms="-",
        choice="-",
        choice_ms="-",
        kernel_ms=kernel_ms,
        full_ms="-",
        quest_x_full="-",
        gbps=kv_bytes / kernel_ms / 1e6,
        decode=decode_kernel(args.head_dim, kind),
    )
    return row


def decode_kernel(head_dim: int, dtype: str) -> str:
    """The kernel decode_attention's route takes for a decode with no policy scores
    (kernel_ms); ``dtype``: the pages' (an fp8 one with a bf16 q)."""
    gqa = geometry.decode_gqa_applies(head_dim, dtype)
    if dtype in geometry.KV_DTYPES:
        return geometry.DECODE_GQA_FP8_KERNEL if gqa else geometry.DECODE_FP8_KERNEL
    return geometry.DECODE_GQA_KERNEL if gqa else "attn_decode_split"


def baselines(cache, q, kept, args, sync):
    """SDPA (and FlexAttention) over the same number of kept tokens, contiguous in torch."""
    import torch
    import torch.nn.functional as F

    shape = (cache.batch, KV_HEADS, kept, args.head_dim)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q_shape = (cache.batch, HEADS, args.t_q, args.head_dim)
    tq = torch.randn(q_shape, device="cuda", dtype=torch.bfloat16)
    out = {
        "sdpa_ms": median_ms(
            lambda: F.scaled_dot_product_attention(tq, k, v, enable_gqa=True),
            torch.cuda.synchronize,
            args.repeats,
        )
    }
    try:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention)
        out["flex_ms"] = median_ms(
            lambda: flex(tq, k, v, enable_gqa=True), torch.cuda.synchronize, args.repeats
        )
    except Exception as err:  # a torch without FlexAttention or its GQA path: say so
        out["flex_ms"] = f"n/a ({type(err).__name__})"
    out.update(flex_paged(tq, k, v, args))
    out["flashinfer_ms"] = flashinfer_paged(tq, k, v, args)
    return out


def flashinfer_paged(tq, k, v, args):
    """FlashInfer's batch decode over the same kept tokens in shuffled pages of our page size
    (cuattn/tools/bench/flashinfer_paged.py), or why not: it does not import, or t_q > 1."""
    import torch

    from cuattn.tools.bench.flashinfer_paged import paged_decode

    try:
        decode = paged_decode(k, v, args.page, HEADS)
        decode(tq)  # refuses t_q > 1 by name before any timing
    except ImportError:
        return "n/a (no flashinfer)"
    except Exception as err:  # a release whose API or kernels refuse this case: say which
        return f"n/a ({type(err).__name__}: {str(err)[:80]})"
    return median_ms(lambda: decode(tq), torch.cuda.synchronize, args.repeats)


def flex_paged(tq, k, v, args):
    """FlexAttention's paged decode over the same kept tokens in shuffled pages of our page
    size, or of FLEX_FALLBACK_PAGE tokens if its kernels refuse that size."""
    import torch

    from cuattn.tools.bench.flex_paged import paged_decode

    error = None
    for page in dict.fromkeys((args.page, FLEX_FALLBACK_PAGE)):
        try:
            decode = paged_decode(k, v, page)
            ms = median_ms(lambda d=decode: d(tq), torch.cuda.synchronize, args.repeats)
            return {"flex_paged_ms": ms, "flex_page": page}
        except Exception as err:  # an older torch, or a page size its kernels do not take
            error = err
    return {"flex_paged_ms": f"n/a ({type(error).__name__})", "flex_page": "-"}


def _cases(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(b), int(n)) for b, n in (case.split("x") for case in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxCONTEXT,..., got {text!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny, the interpreter")
    parser.add_argument(
        "--policies", nargs="+", default=["full", "sliding", "streaming", "h2o", "quest"]
    )
    parser.add_argument(
        "--cases", type=_cases, help="BATCHxCONTEXT,... instead of the sweep's, e.g. 64x32768"
    )
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--t-q", type=int, default=1, help="queries per sequence and step")
    parser.add_argument("--page", type=int, help=f"tokens per page (default {PAGE}; smoke: 8)")
    parser.add_argument(
        "--decode",
        choices=geometry.DECODE_FAMILIES,
        help=f"the decode kernel family ({geometry.DECODE_ENV}; default: the environment's)",
    )
    parser.add_argument(
        "--quest",
        choices=geometry.QUEST_FAMILIES,
        help=f"Quest's page choice on a GPU ({geometry.QUEST_ENV}: 'xp', the array library, or "
        "'kernel', quest_select; default: the environment's; the smoke always runs the kernel)",
    )
    parser.add_argument(
        "--pages",
        choices=("bfloat16", *geometry.KV_DTYPES),
        default="bfloat16",
        help="the cache's pages: bf16, or fp8 codes with a scale a page (q stays bf16)",
    )
    args = parser.parse_args()
    if args.decode:
        os.environ[geometry.DECODE_ENV] = args.decode
    if args.quest:
        os.environ[geometry.QUEST_ENV] = args.quest
    fp8 = args.pages in geometry.KV_DTYPES
    if fp8:  # the fp8 kernels are opt-in on a GPU until one has run them
        os.environ[geometry.DECODE_FP8_ENV] = geometry.DECODE_FP8_KERNEL_FAMILY
    if args.smoke:
        # the tensor-core kernel takes 16-bit types only, fp8 pages a 16-bit q
        gqa = geometry.decode_family() == geometry.DECODE_GQA_FAMILY
        smoke_dtype = "bfloat16" if gqa or fp8 else "float32"
        xp, dtype, backend, cases = np, smoke_dtype, "interp", args.cases or SMOKE
        args.head_dim, args.repeats, args.baselines = 16, 2, False
        args.page = args.page or SMOKE_PAGE
    else:
        import cupy as xp

        dtype, backend = "bfloat16", None
        cases = args.cases or (QUICK if args.quick else FULL)
        args.head_dim, args.repeats, args.baselines = HEAD_DIM, REPEATS, True
        args.page = args.page or PAGE
    rows = (
        row
        for b, n in cases
        for p in args.policies
        for row in run_case(args, b, n, p, xp, dtype, backend)
    )
    report_rows(rows, args.markdown)


if __name__ == "__main__":
    main()
