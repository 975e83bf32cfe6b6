"""Launch geometry of every cuattn kernel, computed and checked in one place.

One frozen dataclass per launch: it derives the grid, the block (warps), the dynamic shared
memory, the C++ name expression and the argument list of one kernel instantiation. The CUDA
runtime (backends/cuda_runtime.py) and the CPU interpreter (backends/interp.py) both launch
from these objects, so the two backends can never disagree about geometry. Tile sizes are chosen
here (``tile_sizes``) and passed to the kernels as template arguments; the ``*_traits`` structs in
kernels/*.cu derive the rest, and the interpreter checks on every launch that the two agree.

Launch sequences (argument names as in KERNEL_ARGS; layout arrays ptr/idx/mask are the CSR
row_ptr/col_idx/row_mask for attn_fwd and attn_bwd_dq, the CSC col_ptr/row_idx/col_mask for
attn_bwd_dkdv; mask_table is the layout's uint32 table, never a null pointer):
  forward:   attn_fwd -> out, lse (float32)
  backward:  attn_bwd_preprocess -> delta (float32 [batch, heads, n_q]), then
             attn_bwd_dkdv -> dk, dv (per query head: [batch, heads, n_k, head_dim]), then
             attn_bwd_dq -> dq, and under GQA attn_bwd_sum_groups -> dk, dv per kv head (grid
             over kv heads); no atomics: bit-identical runs.
Shape scalars: n_q queries, n_k keys, q_offset = n_k - n_q (query row q sits at position
q + q_offset for the causal and window rules), kv_group = heads / kv_heads, num_blocks = entries
per head of the walked index (query blocks for CSR, key blocks for CSC).
Compile: kernels/ must be on the include path (-I); -std=c++17; fast-math is not needed.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cuattn._util import ceil_div, dtype_name

BLOCK_SIZES = (16, 32, 64, 128)
HEAD_DIMS = (16, 32, 48, 64, 80, 96, 128, 256)
DTYPES = ("float32", "float16", "bfloat16")
RULES = ("none", "causal", "window", "bitmask")

CXX_TYPE = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
# fp8 KV pages (cuattn/serving/fp8.py): the codes' C++ types (kernels/common/types.cuh), read
# by the fp8 decode kernels beside q of DECODE_FP8_Q_DTYPES
KV_DTYPES = ("float8_e4m3fn", "float8_e5m2")
KV_CXX_TYPE = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
DECODE_FP8_Q_DTYPES = ("float16", "bfloat16")
CXX_RULE = {
    "none": "MASK_NONE",
    "causal": "MASK_CAUSAL",
    "window": "MASK_WINDOW",
    "bitmask": "MASK_BITMASK",
}
# The block kernels' score-modifier flag (kernels/common/types.cuh ScoreModsFlag): the plain
# kernels, and a variant reading the modifiers' runtime values (backends/call.py ScoreMods).
CXX_MODS = {False: "MODS_NONE", True: "MODS_SCORE"}

WARP_SIZE = 32
SMEM_PAD_BYTES = 16  # row padding of shared tiles (kernels/common/smem.cuh SmemStride)
GRID_YZ_LIMIT = 65535  # CUDA's limit on grid.y and grid.z
# attn_fwd_sm90 numbers its CTAs in 32 bits (kernels/common/types.cuh, cta_tile_longest_first):
# a call's batch x heads x rows (its tiles hold one row or more) must stay under this.
CTA_COUNT_LIMIT = 2**32
SM80_SMEM_LIMIT = 163 * 1024  # opt-in maximum per block on sm_80
SM90_SMEM_LIMIT = 227 * 1024  # on sm_90: the limit of the kernels that run there alone
ROWS_PER_CTA_ELEMENTWISE = 16  # rows per CTA of the row kernels (one warp per row)
ELEMENTWISE_WARPS = 4

# kernel name -> source file (relative to kernels/)
KERNEL_FILES = {
    "attn_fwd": "attn_fwd.cu",
    "attn_bwd_preprocess": "attn_bwd.cu",
    "attn_bwd_dkdv": "attn_bwd.cu",
    "attn_bwd_dq": "attn_bwd.cu",
    "attn_bwd_sum_groups": "attn_bwd.cu",
    "merge_states": "merge_states.cu",
    "attn_decode_split": "attn_decode.cu",
    "attn_decode_merge": "merge_states.cu",
    "attn_decode_mass": "attn_decode.cu",
    "attn_decode_gqa": "attn_decode_gqa.cu",
    "attn_decode_split_fp8": "attn_decode.cu",
    "attn_decode_gqa_fp8": "attn_decode_gqa.cu",
    "select_topk": "layout_build.cu",
    "select_mass": "layout_build.cu",
    "layout_count": "layout_build.cu",
    "layout_scan": "layout_build.cu",
    "layout_fill": "layout_build.cu",
    "mask_vertical_slash": "layout_build.cu",
    "sm90_work_count": "layout_build.cu",
    "sm90_work_scan": "layout_build.cu",
    "sm90_work_fill": "layout_build.cu",
    "sm90_work_order": "layout_build.cu",
    "sm90_claim_order": "layout_build.cu",
    "sm90_dq_ranks": "layout_build.cu",
    "attn_fwd_sm90": "attn_fwd_sm90.cu",
    "attn_fwd_sm90_persistent": "attn_fwd_sm90.cu",
    "attn_fwd_sm90_merge": "attn_fwd_sm90.cu",
    "attn_bwd_sm90": "attn_bwd_sm90.cu",
    "attn_bwd_sm90_persistent": "attn_bwd_sm90.cu",
    "attn_bwd_sm90_dq": "attn_bwd_sm90.cu",
    "quest_select": "quest_select.cu",
    "quest_select_rows": "quest_select.cu",
}
# Templated on <BLOCK, tile(s), HEAD_DIM, T, RULE>.
BLOCK_KERNELS = ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq")

# The sm_90a forward (kernels/attn_fwd_sm90.cu, issue 27): wgmma over 128-byte-swizzled tiles,
# two warpgroups of 64 query rows per CTA, fp16/bf16 only, no score modifiers. It builds for
# sm_90a alone (NVRTC to a cubin: neither sm_80 nor CuPy's own build of the device's sm_90 takes
# wgmma), so all_configs() leaves it out and sm90_configs() lists it. By default (CUATTN_KERNELS
# unset or "auto") an sm_90 GPU runs it for every forward it supports: on the H200 it passed every
# kernel test and ran 1.39x (64-blocks) and 1.54x (128-blocks) faster than attn_fwd; the
# interpreter, which emulates both, keeps attn_fwd
# unless asked. "sm90a" chooses it wherever it applies, the interpreter included; "mma" never.
SM90_FWD = "attn_fwd_sm90"
SM90_ARCH = "sm_90a"
SM90_COMPUTE_CAPABILITY = "90"  # CuPy's spelling of an H100/H200's 9.0
SM90_TILE_M = 128  # query rows per CTA: two consumer warpgroups of wgmma's M = 64
SM90_WARPS = 12  # a producer warpgroup (TMA) and the two consumers
SM90_WARPGROUP_WARPS = 4
SM90_CONSUMER_ROWS = 64  # a consumer warpgroup's query rows: wgmma's M
SM90_BLOCKS = (64, 128)  # a warpgroup's 64 rows lie in one layout block
SM90_HEAD_DIMS = (64, 128, 256)  # whole 128-byte panels; N <= 256 for O += P V
SM90_DTYPES = ("float16", "bfloat16")
# 128-blocks take 128-key tiles up to d = 128 (S and O: 64 + 64 accumulators a thread) and
# 64-key tiles at d = 256 (O alone is 128); 64-blocks take 64-key tiles.
SM90_WIDE_TILE_N = 128
SM90_TILE_N = 64
SM90_WIDE_MAX_HEAD_DIM = 128
# 64-blocks on 128-key tiles of two adjacent key blocks (attn_fwd_sm90<64, 128, ...>: each half
# under its own block's entry mask, a half a consumer's row lacks skipped): what
# CUATTN_SM90_TILE_N=128 asks of both sm_90a forwards. It has never run on a GPU, so 64-key tiles
# stay the default; its instantiations (sm90_configs) are bf16's at d <= 128 alone, which keeps
# the compile sweep small; another dtype or head dim keeps 64-key tiles.
SM90_TILE_N_ENV = "CUATTN_SM90_TILE_N"
SM90_TILE_N_CHOICES = (str(SM90_TILE_N), str(SM90_WIDE_TILE_N))
SM90_KEY_PAIR_BLOCK = 64
SM90_KEY_PAIR_HEAD_DIMS = (64, 128)
SM90_KEY_PAIR_DTYPES = ("bfloat16",)
# The sm_90a forwards' rescale skip (FlashAttention-4's): O and l_i are left unscaled on a tile
# whose row max grows by at most 2^8 over the max the exponentials use (kernels/attn_fwd_sm90.cu,
# RESCALE_SKIP; exact in real arithmetic, not bit-identical to rescaling every tile). What
# CUATTN_SM90_RESCALE=skip asks of both; it has never run on a GPU, so "always" stays the
# default. Its instantiations (sm90_configs) are the 64-key and 128-key tiles of the two block
# sizes at d <= 128, both dtypes; key pairs and d = 256 keep rescaling every tile.
SM90_RESCALE_ENV = "CUATTN_SM90_RESCALE"
SM90_RESCALE_ALWAYS = "always"
SM90_RESCALE_SKIP = "skip"
SM90_RESCALE_CHOICES = (SM90_RESCALE_ALWAYS, SM90_RESCALE_SKIP)
SM90_RESCALE_SKIP_HEAD_DIMS = (64, 128)
# The sm_90a forwards' exp2 on the FMA pipe (FlashAttention-4's): a quarter of each row's softmax
# exp2 by a polynomial (kernels/common/exp2_poly.cuh) instead of MUFU (kernels/attn_fwd_sm90.cu,
# EXP2_POLY; P within a twentieth of T's rounding of it, not bit-identical to "mufu"). What
# CUATTN_SM90_EXP2=poly asks of both; it has never run on a GPU, so "mufu" stays the default. Its
# instantiations (sm90_configs) are the rescale skip's shapes at d = 64, with either rescale.
SM90_EXP2_ENV = "CUATTN_SM90_EXP2"
SM90_EXP2_MUFU = "mufu"
SM90_EXP2_POLY = "poly"
SM90_EXP2_CHOICES = (SM90_EXP2_MUFU, SM90_EXP2_POLY)
SM90_EXP2_POLY_HEAD_DIMS = (64,)  # where MUFU binds beside the tensor pipe; at d128 it does not
# attn_fwd_sm90 with three consumer warpgroups at d = 64 (FlashAttention-3's choice there): CTAs
# of 192 query rows, three adjacent 64-blocks walked as the union of their rows, 512 threads
# (kernels/attn_fwd_sm90.cu, CONSUMERS = 3). What CUATTN_SM90_D64_CONSUMERS=3 asks; it has never
# run on a GPU, so two stay the default. Its instantiations (sm90_configs) are d = 64 at 64-blocks
# on 64-key tiles, both dtypes, every rule, with the default rescale and exp2: key pairs (128-key
# tiles), the rescale skip and the exp2 polynomial, where asked too, keep two consumers, and so do
# 128-blocks (192 rows would cut a block) and the persistent forward.
SM90_CONSUMERS_ENV = "CUATTN_SM90_D64_CONSUMERS"
SM90_CONSUMERS = 2
SM90_D64_CONSUMERS = 3
SM90_CONSUMERS_CHOICES = (str(SM90_CONSUMERS), str(SM90_D64_CONSUMERS))
SM90_D64_CONSUMERS_HEAD_DIM = 64
SM90_D64_CONSUMERS_BLOCK = 64
SM90_KV_STAGES = 2  # stages of the K ring and of the V ring
SM90_BARRIERS = 1 + 4 * SM90_KV_STAGES  # q_full; a full and an empty a stage of K and of V
SM90_BARRIER_BYTES = 8
SM90_SWIZZLE_ROW_BYTES = 128  # a panel row: the 128-byte swizzle's unit
SM90_SWIZZLE_REPEAT_BYTES = 1024  # room to start the tiles on the swizzle's repeat
# q, k and v reach attn_fwd_sm90 as rank-4 TMA tensor maps (kernels/common/tma.cuh; columns,
# rows, heads, batch), each copy one 64-column panel (128 bytes, the 128-byte swizzle's width)
# of the CTA's rows (q) or a key tile (k, v); a swizzled map's base is 128-byte aligned.
SM90_PANEL_BYTES = 128
SM90_MAP_ALIGNMENT = 128
SM90_STORE_ROWS = 64  # out is stored a consumer warpgroup's rows at a time
# attn_fwd_sm90's CTAs start longest rows first within groups of (head, batch) pairs whose K and
# V together are at most this many bytes (kernels/common/types.cuh, cta_tile_longest_first):
# the resident CTAs then share their key tiles through the L2 (60 MB on an H200, ~30 MB of it
# effective for this reuse) instead of each streaming its own head from DRAM (ungrouped, the
# H200 read K and V 8 to 15 times over).
SM90_L2_GROUP_BYTES = 16 * 2**20
# The sm_90a backward (kernels/attn_bwd_sm90.cu): one CTA per 128 keys (a 128-block),
# kv head and batch, two consumer warpgroups of 64 keys, steps of 64 queries; dQ goes into an
# fp32 accumulator [batch, heads, n_q rounded up to the step, d] by ordered bulk reduces (a
# semaphore per step tile, a work counter), then attn_bwd_sm90_dq scales and converts it. It has
# never run on a GPU: only CUATTN_KERNELS=sm90a chooses it (the interpreter included), for
# fp16/bf16, 64- and 128-blocks, head dims 64 and 128, no score modifier; everything else keeps
# attn_bwd_dkdv + attn_bwd_dq. Its instantiations: sm90_backward_configs().
SM90_BWD = "attn_bwd_sm90"
SM90_BWD_DQ = "attn_bwd_sm90_dq"  # one warp per row, row_kernel_traits
SM90_BWD_BLOCKS = (64, 128)  # a 64-block CTA owns two key blocks, one per consumer
SM90_BWD_HEAD_DIMS = (64, 128)
SM90_BWD_TILE_K = 128  # keys per CTA: two consumer warpgroups of wgmma's M = 64
SM90_BWD_TILE_Q = 64  # queries per step: one 128-byte panel row of dS^T
SM90_BWD_STAGES = 2  # stages of each step's Q, dO, lse and delta
SM90_BWD_DS_STAGES = 2  # dS^T stages (the next step's stores never meet the dQ GEMM's reads)
# kv_full, dq_full, dq_empty; a full and an empty barrier a stage
SM90_BWD_BARRIERS = 3 + 2 * SM90_BWD_STAGES
# What CUATTN_BWD_DQ asks of attn_bwd_sm90's dQ reduces: "ordered" (also when unset: the adds
# into each dQ tile in the layout's order, so the gradients are bit-identical run to run) or
# "unordered" (the instantiation without the semaphore waits: each reduce is issued as soon as
# its step is computed, the adds into a tile land in whatever order the CTAs reach them, and dQ's
# low bits may differ run to run; dK and dV do not). Opt-in, named: the ordered one is the
# contract.
BWD_DQ_ENV = "CUATTN_BWD_DQ"
BWD_DQ_ORDERED = "ordered"
BWD_DQ_UNORDERED = "unordered"
BWD_DQ_ORDERS = (BWD_DQ_ORDERED, BWD_DQ_UNORDERED)
# How attn_bwd_sm90's work is scheduled (CUATTN_BWD_SM90): "one-shot" (also when unset: a CTA
# per key tile, kv head and batch) or "persistent" (attn_bwd_sm90_persistent: one CTA an SM
# claiming the same items in the same order, the next item's K and V copied under the current
# one's epilogue; the same bits). Opt-in: it has never run on a GPU.
SM90_BWD_PERSISTENT = "attn_bwd_sm90_persistent"
SM90_BWD_KERNELS = (SM90_BWD, SM90_BWD_PERSISTENT)
BWD_SM90_ENV = "CUATTN_BWD_SM90"
BWD_SM90_ONE_SHOT = "one-shot"
BWD_SM90_PERSISTENT = "persistent"
BWD_SM90_SCHEDULES = (BWD_SM90_ONE_SHOT, BWD_SM90_PERSISTENT)
# (block, head dim, rule) the persistent backward has no instantiation for: at d = 128 with
# 64-blocks the window and bitmask rules leave its item loop a register or three short (ptxas
# spills 4-12 bytes); there CUATTN_BWD_SM90=persistent keeps attn_bwd_sm90.
SM90_BWD_PERSISTENT_SPILLS = ((64, 128, "window"), (64, 128, "bitmask"))
# The persistent sm_90a forward (issue 53): attn_fwd_sm90's items taken by one CTA an SM from a
# work list built from the layout (sm90_work_list) through a zeroed counter. It has never run on
# a GPU: only CUATTN_KERNELS=sm90a-persistent chooses it (the interpreter included), wherever
# attn_fwd_sm90 applies; the backward stays attn_bwd_dkdv + attn_bwd_dq there.
SM90_FWD_PERSISTENT = "attn_fwd_sm90_persistent"
SM90_PERSISTENT_HEAD_DIMS = (64, 128, 256)
SM90_FWD_KERNELS = (SM90_FWD, SM90_FWD_PERSISTENT)
# Q tiles a persistent CTA: the next item's Q lands in one while the current item computes from
# the other (a second tile of 16 or 32 KB fits beside the rings at d <= 128, every key tile); at
# d = 256 one (a second 64 KB tile does not fit beside the rings' 128 KB):
# sm90_persistent_q_buffers.
SM90_PERSISTENT_Q_BUFFERS = 2
SM90_PERSISTENT_DOUBLE_Q_MAX_HEAD_DIM = 128


def sm90_persistent_q_buffers(head_dim: int) -> int:
    """Q tiles a persistent sm_90a CTA holds at this head dim."""
    return SM90_PERSISTENT_Q_BUFFERS if head_dim <= SM90_PERSISTENT_DOUBLE_Q_MAX_HEAD_DIM else 1


def sm90_persistent_smem_bytes(q_buffers: int) -> int:
    """Its shared memory beyond attn_fwd_sm90's and its Q tiles: the other tiles' q_full, a
    q_empty and an item slot a Q tile, and the producer's state (the place claimed, the count
    of items published, the claimed entry's four row entries)."""
    return (q_buffers - 1) * SM90_BARRIER_BYTES + q_buffers * (SM90_BARRIER_BYTES + 4) + (2 + 4) * 4


SM90_PERSISTENT_SMEM_BYTES = sm90_persistent_smem_bytes(SM90_PERSISTENT_Q_BUFFERS)  # d <= 128
# An H100 SXM's and an H200's SMs: the persistent grid and the few-items rule's SMs where no
# device is asked (the interpreter); a GPU backend passes its device's own count
# (KernelBackend.multiprocessors: 114 on an H100 PCIe).
SM90_SMS = 132
# Rows far longer than the rest (BigBird's and Longformer's global rows walk every key tile while
# the others walk a few) are split into chunks of their key blocks, each chunk an item of its
# own: the one CTA holding a whole global row otherwise ends 1.4-1.5x after the others. A row is
# split when it walks more than SM90_SPLIT_FACTOR x the mean item's key tiles (and more than
# SM90_SPLIT_MIN_TILES: a chunk pays an item's fixed cost), into chunks of at most that many
# tiles. Each chunk writes its partial (out, lse) in float32 to a slot of a workspace, and
# SM90_FWD_MERGE merges a row's chunks through the LSE in chunk order after the launch: the
# same bits whichever CTA computed which chunk.
# A launch of fewer items than SMs (the device's own count, both on the host and in the
# device-built list) leaves SMs idle whatever its rows' lengths (a batch of 1 with few heads):
# there the threshold falls to the walked tiles of the whole launch over the SMs (at least
# SM90_SPLIT_MIN_TILES), so that the chunks fill about one wave. With as many items as SMs
# or more the mean's threshold stays: splitting such launches further is predicted to cost 0-35 %
# (a longer tail of chunks sorted longest first, and the merge's launch).
SM90_SPLIT_FACTOR = 4
SM90_SPLIT_MIN_TILES = 8
# The few-items threshold applies only where the longest item walks more than
# SM90_FEW_ITEMS_SPREAD_PERCENT / 100 x that fill: unsplit, such a launch ends with its longest
# item (one an SM), and split it ends no sooner than the fill, so the split can gain at most
# 1 - fill / longest, less the chunks' tail (sorted longest first) and the merge. Where the rows
# are about even (dense, bidirectional local and fixed at 64-128 items: longest / fill
# 1.00-1.25) or differ by little (window at 2 heads of 8k: 1.32-1.38) the split is predicted to
# cost 4-33 %; from 1.60 up (window at 4 heads of 4k, causal and document rows, global rows) it
# gains 6-57 % (dev/schedule.py's few_items_table). In integers, so that the host and the
# device-built list decide alike.
SM90_FEW_ITEMS_SPREAD_PERCENT = 150
# A launch's chunks write at most SM90_SPLIT_SLOTS_PER_SM x its SMs partial slots (all batches
# together): where the threshold above would split more, it is raised to the lowest one whose
# chunks fit (the longest rows keep their split, in fewer, longer chunks). The split balances the
# tail over the SMs, so a few chunks an SM are all it needs: the bench patterns at T = 8192 split
# into at most 2 x SMs slots, and 8 an SM is predicted to cost under 1 % where it binds (4: up to
# 1.6 %; dev/schedule.py's cap_table). It bounds the device-built list's workspace, sized
# before the list's length is known, by the SMs rather than by the layout: 1056 slots, 66 MiB
# of float32 partials at d = 128, where T = 128k, 32 heads, batch 8 would reach 8 GiB.
SM90_SPLIT_SLOTS_PER_SM = 8
# A work list entry: the item (pair * query tiles + tile), its key blocks [first, end), the
# workspace slot of a chunk (SM90_NO_SLOT: an unsplit row, stored to out and lse), and where
# those key blocks lie in the item's CSR rows: entries [first, end) of its first block's row,
# then of its second's (64-blocks; 0, 0 where there is none), counted from each row's first
# entry (the kernel cuts its walk with them and searches nothing).
SM90_WORK_FIELDS = 8
SM90_ITEM_ROWS = 2  # CSR rows an item's entry names: a 64-block item's two (128-blocks: one)
SM90_NO_SLOT = -1
# A merge list entry: the item, its first chunk's slot (the rest follow), its chunks.
SM90_MERGE_FIELDS = 3
SM90_FWD_MERGE = "attn_fwd_sm90_merge"  # one warp per row, row_kernel_traits
# built for sm_90a alone
SM90_KERNELS = (SM90_FWD, SM90_FWD_PERSISTENT, SM90_FWD_MERGE, *SM90_BWD_KERNELS, SM90_BWD_DQ)
# The row kernels of the sm_90a family (row_kernel_traits, grid of ROWS_PER_CTA_ELEMENTWISE rows)
SM90_ROW_KERNELS = (SM90_FWD_MERGE, SM90_BWD_DQ)
KERNELS_ENV = "CUATTN_KERNELS"
AUTO_FAMILY = "auto"  # the default: the backend's own choice (KernelBackend.sm90a_by_default)
MMA_FAMILY = "mma"
SM90_FAMILY = "sm90a"
SM90_PERSISTENT_FAMILY = "sm90a-persistent"  # SM90_FAMILY's forward on SM90_FWD_PERSISTENT
KERNEL_FAMILIES = (AUTO_FAMILY, MMA_FAMILY, SM90_FAMILY, SM90_PERSISTENT_FAMILY)
# One warp per row, templated on <HEAD_DIM, T>; their traits: kernels/common/row_kernel.cuh.
ROW_KERNELS = ("attn_bwd_preprocess", "attn_bwd_sum_groups", "merge_states", "attn_decode_merge")
# Split-KV decode over a paged cache, templated on <TILE, ROWS, HEAD_DIM, T>; traits in
# kernels/attn_decode.cu. A CTA's 4 warps each copy and compute sub-tiles of TILE / 4 tokens in
# two cp.async stages of their own; TILE is chosen so one K tile is about DECODE_TILE_BYTES
# (deep enough copies to keep HBM busy, 2 CTAs per SM at d = 128), and ROWS query rows of a kv
# group share every K/V read.
DECODE_KERNELS = ("attn_decode_split", "attn_decode_split_fp8")
# attn_decode_split over fp8 pages: templated on <TILE, ROWS, HEAD_DIM, T, KV, MODS>, its tile
# sized by the codes' bytes, and two more arguments, the pages' float32 scales
DECODE_FP8_KERNEL = "attn_decode_split_fp8"
DECODE_WARPS = 4
DECODE_TILE_BYTES = 16 * 1024
DECODE_MIN_TILE = 16  # 4 tokens per warp: 8 lanes split a token's head dim
DECODE_MAX_TILE = 64  # 16 tokens per warp: 2 lanes per token
DECODE_ROWS_PER_CTA = 16
# Head dim 256 (HUGE_HEAD_DIM): 8 rows, so the per-lane accumulators (rows x 8 floats) stay in
# registers.
DECODE_ROWS_PER_CTA_HUGE_HEAD = 8
DECODE_STAGES = 2  # per warp (kernels/attn_decode.cu STAGES)
DECODE_MAX_SPLITS = 64
DECODE_MAX_SLOTS = 2**31 - 1  # the kernel indexes the pool's slots in int32
DECODE_MASS_KERNEL = "attn_decode_mass"  # HeavyHitters' score update: a thread per table slot
DECODE_MASS_THREADS = 128
# Registers per thread assumed when sizing the split count before the kernel is loaded: the
# NVRTC report's count for d = 128, 16-bit, on sm_90 (234, allocated in steps of 8); occupancy
# here only decides how many CTAs fill a GPU.
DECODE_REGISTERS_ASSUMED = 240

# The tensor-core decode (kernels/attn_decode_gqa.cu),
# templated on <TILE, HEAD_DIM, T, MODS>: a producer warp streams tiles of TILE tokens' K and V
# through decode_gqa_stages shared-memory stages (a consumer warp's per tile of a producer round)
# while 4 consumer warps compute 16 query rows of a kv group (the M of mma.sync m16n8k16) against
# them. fp16/bf16 at head dims 16 to 256 (fp32 keeps attn_decode_split); its MODS_SCORE variant
# takes the score modifiers, HeavyHitters' per-token scores and fp16 at any scale
# (decode_gqa_mods). Past DECODE_GQA_WIDE_HEAD_DIM (d256) Q's tile stays in shared memory, as in
# the MODS_SCORE variant, and a CTA runs alone on its SM (O alone is 128 registers a lane).
# Opt-in: it has not run on a GPU yet, so CUATTN_DECODE=gqa chooses it where it applies and the
# default ("split") never does.
DECODE_GQA_KERNEL = "attn_decode_gqa"
# attn_decode_gqa over fp8 pages, templated on <TILE, HEAD_DIM, T, KV>: bf16 q only (the
# instantiations made; Q K^T and P V run on fp16 tensor cores, Q times a power of two and P
# with its V scale relative to its tile's largest, in fp16's range either way), TILE half of
# bf16's (decode_gqa_fp8_tile: each consumer widens its stage's codes into fp16 tiles of its
# own; at bf16's TILE, d128 needed 218 registers, one CTA an SM, and d64 117 KB of shared
# memory)
DECODE_GQA_FP8_KERNEL = "attn_decode_gqa_fp8"
DECODE_GQA_FP8_Q_DTYPES = ("bfloat16",)
DECODE_GQA_KERNELS = (DECODE_GQA_KERNEL, DECODE_GQA_FP8_KERNEL)
# The kernels with a score-modifier variant (a last template flag, CXX_MODS).
MODS_KERNELS = BLOCK_KERNELS + DECODE_KERNELS + DECODE_GQA_KERNELS
DECODE_GQA_ROWS = 16
# Stages: one per consumer warp and tile of a producer round (decode_gqa_stages)
DECODE_GQA_CONSUMERS = 4
DECODE_GQA_WARPS = DECODE_GQA_CONSUMERS + 1  # and the producer
# attn_decode_gqa_fp8 from this head dim up: two producer warps taking alternate rounds (the one
# producer's warp scheduler, shared with consumer 0, was the busiest); 2 CTAs of 6 warps at d128
DECODE_GQA_FP8_TWO_PRODUCERS_HEAD_DIM = 128
DECODE_GQA_TILE_BYTES = 8 * 1024  # one stage's K tile, as many bytes of V
DECODE_GQA_MIN_TILE = 16  # a whole m16n8k16 step
DECODE_GQA_MAX_TILE = 64
# The modifier variant's tiles: at most 32 tokens (a lane's S is TILE / 2 registers; at 64 the
# modifiers' operands beside it spilled at d16 and d48)
DECODE_GQA_MODS_MAX_TILE = 32
ITEMSIZE_OF_COPY = 16  # bytes of one cp.async: 16 fp8 codes
DECODE_GQA_DTYPES = ("float16", "bfloat16")
DECODE_GQA_HEAD_DIMS = (16, 32, 48, 64, 80, 96, 128, 256)
# The widest head dim whose Q fragments stay in registers (two CTAs an SM); past it Q's scaled
# tile is in shared memory and one CTA runs an SM (attn_decode_gqa_traits::WIDE)
DECODE_GQA_WIDE_HEAD_DIM = 128
DECODE_GQA_BARRIER_BYTES = 8
DECODE_GQA_LOG2E = 1.4426950408889634  # Q is pre-scaled by scale * log2(e) for exp2
# Registers per thread assumed when sizing the split count before the kernel is loaded: the
# NVRTC report's most for the instantiations above on sm_90, allocated in steps of 8: at d <=
# DECODE_GQA_WIDE_HEAD_DIM, and past it (one CTA an SM by its launch bounds; its 144-148 KB of
# shared memory hold it to one either way).
DECODE_GQA_REGISTERS_ASSUMED = 168
DECODE_GQA_WIDE_REGISTERS_ASSUMED = 224
# Split counts: the fewest whose wave efficiency is within this fraction of the best.
DECODE_GQA_WAVE_SLACK = 0.9
DECODE_ENV = "CUATTN_DECODE"
DECODE_SPLIT_FAMILY = "split"
DECODE_GQA_FAMILY = "gqa"
DECODE_FAMILIES = (DECODE_SPLIT_FAMILY, DECODE_GQA_FAMILY)
# fp8 pages on a GPU: refused until a GPU has run attn_decode_split_fp8 ("off", the default), or
# run by it ("kernel"); the interpreter always runs it
DECODE_FP8_ENV = "CUATTN_DECODE_FP8"
DECODE_FP8_OFF_FAMILY = "off"
DECODE_FP8_KERNEL_FAMILY = "kernel"
DECODE_FP8_FAMILIES = (DECODE_FP8_OFF_FAMILY, DECODE_FP8_KERNEL_FAMILY)
# The score-modifier kernels' dense score bias, opt-in on a GPU the same way until one has run it
SCORE_BIAS_ENV = "CUATTN_SCORE_BIAS"

# Quest's page choice (kernels/quest_select.cu), templated on <HEAD_DIM, T, B> (B: the key
# bounds' type, QUEST_BOUND_DTYPES): a CTA of QUEST_SELECT_WARPS warps per (sequence, kv head)
# and split of its table computes each page's bound for the kv group's query rows into a float32
# workspace; with one split the same CTA selects each row's pages by a radix select over
# QUEST_SELECT_BINS-bin histograms (one a warp, in shared memory), with more
# quest_select_rows does, a CTA of QUEST_ROWS_WARPS warps a row sharing one histogram. Splits
# (quest_splits) only where the pairs leave the GPU's waves part empty. On a GPU opt-in until one
# has run it: CUATTN_QUEST=kernel chooses it, "xp" (the default) keeps the CuPy path; the
# interpreter always runs it.
QUEST_SELECT_KERNEL = "quest_select"
QUEST_ROWS_KERNEL = "quest_select_rows"
QUEST_SELECT_WARPS = 8
QUEST_SELECT_BINS = 256
QUEST_ROWS_WARPS = 8
QUEST_BOUND_DTYPES = ("float32", "bfloat16")  # key_min / key_max as the cache keeps them
QUEST_PAGES_IN_FLIGHT = 2  # a warp's pages loaded before their sums (the kernel's traits)
# a split holds at least a page pair for each warp, and there are at most this many a table
QUEST_MIN_SPLIT_PAGES = QUEST_SELECT_WARPS * QUEST_PAGES_IN_FLIGHT
QUEST_MAX_SPLITS = 64
QUEST_WAVE_SLACK = 0.9  # the fewest splits within this fraction of the best wave efficiency
QUEST_ENV = "CUATTN_QUEST"
QUEST_XP_FAMILY = "xp"
QUEST_KERNEL_FAMILY = "kernel"
QUEST_FAMILIES = (QUEST_XP_FAMILY, QUEST_KERNEL_FAMILY)

# Device-side layout construction (kernels/layout_build.cu): the selection kernels sort one row
# of key blocks per CTA in shared memory, templated on <score type, sort size>; the index kernels
# (counts -> scan -> fill of CSR and CSC) have one instantiation each.
SELECT_KERNELS = ("select_topk", "select_mass")
INDEX_KERNELS = ("layout_count", "layout_scan", "layout_fill", "mask_vertical_slash")
# The sm_90a kernels' schedules of a device layout (kernels/layout_build.cu): the persistent
# forward's work list (count, scan, fill, order) and the backward's claim order and dQ ranks.
# Warp-unit kernels (INDEX_WARPS warps a CTA) but for the one-CTA scan and the CTA a kv head.
SCHEDULE_KERNELS = (
    "sm90_work_count",
    "sm90_work_scan",
    "sm90_work_fill",
    "sm90_work_order",
    "sm90_claim_order",
    "sm90_dq_ranks",
)
SCHEDULE_SCAN_KERNELS = ("sm90_work_scan", "sm90_claim_order")  # SCAN_THREADS a CTA
LAYOUT_BUILD_KERNELS = SELECT_KERNELS + INDEX_KERNELS + SCHEDULE_KERNELS
# Key tiles sm90_dq_ranks flags per row in shared memory, and the most key blocks an sm_90a
# backward tile holds (kernels/layout_build.cu MAX_CLAIM_TILES, MAX_TILE_BLOCKS)
SCHEDULE_MAX_TILES = 8192
SCHEDULE_MAX_TILE_BLOCKS = 2
MAX_SELECT_THREADS = 256  # a selection CTA has a thread per sort pair, 32 to this many
SELECT_SCORE_DTYPES = ("float32", "float64")
SELECT_SCORE_CXX = {"float32": "float", "float64": "double"}
# Key blocks one selection CTA sorts: powers of two, 32 .. 8192 (a 512k-token row at block 64;
# 8192 double keys and codes take 96 KB of shared memory, under sm_80's opt-in limit).
SELECT_SORT_SIZES = tuple(2**e for e in range(5, 14))
INDEX_WARPS = 4  # warps per CTA of layout_count / layout_fill: one row or 32-column strip each
SCAN_THREADS = 256
SCAN_CTAS = 2  # layout_scan: CTA 0 the rows (CSR), CTA 1 the columns (CSC)

# Kernel arguments in order: (name, kind); kind "ptr" is a device pointer, "i32"/"i64"/"f32"/"f64"
# scalars. Inputs q, k, v and dout come with the element strides of their batch, head and row
# axes (their last axis is contiguous); every output is contiguous.
_LAYOUT_ARGS = (("ptr", "ptr"), ("idx", "ptr"), ("mask", "ptr"), ("mask_table", "ptr"))
# The score operands (backends/call.py SCORE_OPERANDS), read by the score-modifier variants only
# (block and decode kernels): ALiBi's [batch, heads] float32 slopes at a batch stride (0: one
# slope per head), a per-key bias, float32 rows of keys at element strides of batch and query
# head (0: one row for every head), and a relative-position table [batch, heads, 2M + 1] at a
# batch stride (0: one table per head) with its M; each a one-element stand-in when its use_
# flag is 0.
_SCORE_OPERAND_ARGS = (
    ("alibi_slopes", "ptr"),
    ("use_alibi", "i32"),
    ("alibi_batch_stride", "i32"),
    ("key_bias", "ptr"),
    ("use_key_bias", "i32"),
    ("key_bias_batch_stride", "i64"),
    ("key_bias_head_stride", "i64"),
    ("rel_bias", "ptr"),
    ("use_rel_bias", "i32"),
    ("rel_bias_batch_stride", "i32"),
    ("rel_max_distance", "i32"),
)
# dropout (block and decode kernels): floor(p * 2^32) (0: off), the 64-bit seed, 1 / (1 - p), and
# the seed's two 32-bit words in memory (a traced or device-drawn seed; read with use_seed_words,
# a one-element stand-in otherwise)
_DROPOUT_ARGS = (
    ("dropout_threshold", "i64"),
    ("dropout_seed", "i64"),
    ("dropout_scale", "f32"),
    ("dropout_seed_words", "ptr"),
    ("use_seed_words", "i32"),
)
# A dense score bias (block kernels' score-modifier variants only: the decode kernels take
# none): its first element (any view: the four element strides say where the rest is, 0 along
# a broadcast axis), how it is stored (SCORE_BIAS_KINDS), and its batch, head, query and key
# strides; a one-element stand-in when use_score_bias is 0.
_SCORE_BIAS_ARGS = (
    ("score_bias", "ptr"),
    ("use_score_bias", "i32"),
    ("score_bias_batch_stride", "i64"),
    ("score_bias_head_stride", "i64"),
    ("score_bias_q_stride", "i64"),
    ("score_bias_k_stride", "i64"),
)
# use_score_bias (kernels/common/score_tile.cuh): none, float32, or the kernel's own 16-bit type
SCORE_BIAS_KINDS = {"none": 0, "float32": 1, "narrow": 2}
_RULE_SCALARS = (
    ("n_q", "i32"),
    ("n_k", "i32"),
    ("q_offset", "i32"),
    ("kv_group", "i32"),
    ("num_blocks", "i32"),
    ("scale", "f32"),
    ("window_left", "i32"),
    ("window_right", "i32"),
    ("softcap", "f32"),
    *_SCORE_OPERAND_ARGS,
    *_SCORE_BIAS_ARGS,
    *_DROPOUT_ARGS,
)
STRIDE_AXES = ("batch", "head", "row")


def _strides(tensor: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{tensor}_{axis}_stride", "i64") for axis in STRIDE_AXES)


_FWD_ARGS = (
    ("q", "ptr"),
    ("k", "ptr"),
    ("v", "ptr"),
    ("out", "ptr"),
    ("lse", "ptr"),
    *_LAYOUT_ARGS,
    *_RULE_SCALARS,
    *_strides("q"),
    *_strides("k"),
    *_strides("v"),
)
# What the mma.sync backward passes read: q, k, v, the output's gradient, the forward's lse and
# attn_bwd_preprocess's delta.
_BWD_INPUTS = tuple((name, "ptr") for name in ("q", "k", "v", "dout", "lse", "delta"))
_BWD_STRIDES = (*_strides("q"), *_strides("k"), *_strides("v"), *_strides("dout"))
# Both decode kernels' leading arguments (the cache's arrays, the split partials) and sizes.
_DECODE_CACHE_ARGS = (
    ("q", "ptr"),
    ("k_pages", "ptr"),
    ("v_pages", "ptr"),
    ("slot_pos", "ptr"),
    ("page_table", "ptr"),
    ("page_count", "ptr"),
    ("lengths", "ptr"),
    ("chosen", "ptr"),
    ("part_out", "ptr"),
    ("part_lse", "ptr"),
)
_DECODE_SIZE_ARGS = (
    ("heads", "i32"),
    ("kv_heads", "i32"),
    ("t_q", "i32"),
    ("page_size", "i32"),
    ("max_pages", "i32"),
    # where a (sequence, kv head)'s table row and its tokens' K/V rows are (kernels/attn_decode.cu
    # PageWalk): a KVCache's per-pair tables and pages, or a caller's block table
    ("table_batch_stride", "i32"),
    ("table_head_stride", "i32"),
    ("page_rows", "i32"),
    ("token_rows", "i32"),
    ("head_rows", "i32"),
    ("use_slot_pos", "i32"),  # 1: slot_pos and page_count (a KVCache's); 0: positions in order
    ("splits", "i32"),
    ("pages_per_split", "i32"),
    ("scale", "f32"),
)
# The tensor-core decode kernels' last arguments, read by their MODS_SCORE variant only (after
# every argument of the plain one): HeavyHitters' per-token scores, the modifiers, and whether
# to write the scores
_DECODE_GQA_MOD_ARGS = (
    ("token_scores", "ptr"),
    ("softcap", "f32"),
    *_SCORE_OPERAND_ARGS,
    *_DROPOUT_ARGS,
    ("keep_scores", "i32"),
)
# What both sm_90a forwards take first ("tmap": a TMA tensor map of the named array, its columns
# starting at the "_col" argument)
_SM90_FWD_ARGS = (
    ("q", "tmap"),
    ("k", "tmap"),
    ("v", "tmap"),
    ("out", "tmap"),
    ("q_col", "i32"),
    ("k_col", "i32"),
    ("v_col", "i32"),
    ("out_col", "i32"),
    ("lse", "ptr"),
    *_LAYOUT_ARGS,
    *_RULE_SCALARS[: _RULE_SCALARS.index(("softcap", "f32"))],
)
_SM90_BWD_ARGS = (  # attn_bwd_sm90's; attn_bwd_sm90_persistent adds the pairs' sizes
    ("q", "tmap"),
    ("k", "tmap"),
    ("v", "tmap"),
    ("dout", "tmap"),
    # float32 [batch, heads, 2, n_q_padded]: lse (log2 domain; +inf past n_q and for a row
    # with nothing to attend), then delta (0 past n_q); a box of a step's two rows
    ("stats", "tmap"),
    ("q_col", "i32"),
    ("k_col", "i32"),
    ("v_col", "i32"),
    ("dout_col", "i32"),
    ("dk", "ptr"),
    ("dv", "ptr"),
    ("dq_accum", "ptr"),  # float32 [batch, heads, n_q_padded, d], zeroed
    ("semaphores", "ptr"),  # int32 [batch, heads, n_q_padded / TILE_Q], zeroed
    ("work_counter", "ptr"),  # int32, zeroed
    ("col_ptr", "ptr"),
    ("row_idx", "ptr"),
    ("col_mask", "ptr"),
    ("dq_ranks", "ptr"),  # int32 per CSC entry (kernels.py, dq_ranks)
    # int32 [kv heads, key tiles]: each kv head's key tiles in claim order (kernels.py,
    # backward_tile_order)
    ("tile_order", "ptr"),
    ("mask_table", "ptr"),
    ("n_q", "i32"),
    ("n_k", "i32"),
    ("q_offset", "i32"),
    ("kv_group", "i32"),
    ("num_k_blocks", "i32"),
    ("scale", "f32"),
    ("window_left", "i32"),
    ("window_right", "i32"),
    ("cta_groups", "i32"),  # sm90_backward_cta_groups
)
KERNEL_ARGS: dict[str, tuple[tuple[str, str], ...]] = {
    "attn_fwd": _FWD_ARGS,
    SM90_FWD: (*_SM90_FWD_ARGS, ("cta_groups", "i32")),  # sm90_cta_groups
    SM90_FWD_PERSISTENT: (
        *_SM90_FWD_ARGS,
        ("work_list", "ptr"),  # int32 [num_items, SM90_WORK_FIELDS], Sm90WorkList.items
        ("num_items", "i32"),
        ("heads", "i32"),
        ("work_counter", "ptr"),  # int32, zeroed
        ("part_out", "ptr"),  # float32 [slots, SM90_TILE_M, head_dim]: the chunks' partial outs
        ("part_lse", "ptr"),  # float32 [slots, SM90_TILE_M]
    ),
    SM90_FWD_MERGE: (
        ("part_out", "ptr"),
        ("part_lse", "ptr"),
        ("merge_list", "ptr"),  # int32 [split items, SM90_MERGE_FIELDS], Sm90WorkList.merges
        ("out", "ptr"),  # [batch, heads, n_q, head_dim], contiguous
        ("lse", "ptr"),  # float32 [batch, heads, n_q]
        ("n_q", "i32"),
        ("rows", "i32"),  # split items x SM90_TILE_M
    ),
    SM90_BWD: _SM90_BWD_ARGS,
    # grid (CTAs, 1, 1): the pairs come as arguments
    SM90_BWD_PERSISTENT: (*_SM90_BWD_ARGS, ("kv_heads", "i32"), ("batch_size", "i32")),
    SM90_BWD_DQ: (
        ("dq_accum", "ptr"),
        ("dq", "ptr"),
        ("n_q", "i32"),
        ("n_q_padded", "i32"),
        ("scale", "f32"),
    ),
    "attn_bwd_preprocess": (
        ("out", "ptr"),
        ("dout", "ptr"),
        ("dlse", "ptr"),
        ("delta", "ptr"),
        ("n_q", "i32"),
        ("use_dlse", "i32"),
        *_strides("dout"),
    ),
    "attn_bwd_sum_groups": (
        ("per_head", "ptr"),
        ("summed", "ptr"),
        ("n_k", "i32"),
        ("kv_group", "i32"),
    ),
    "merge_states": (
        ("out_a", "ptr"),
        ("lse_a", "ptr"),
        ("out_b", "ptr"),
        ("lse_b", "ptr"),
        ("out", "ptr"),
        ("lse", "ptr"),
        ("rows", "i32"),
    ),
    "attn_decode_split": (
        *_DECODE_CACHE_ARGS,
        ("token_scores", "ptr"),
        *_DECODE_SIZE_ARGS,
        ("softcap", "f32"),
        *_SCORE_OPERAND_ARGS,
        *_DROPOUT_ARGS,
        ("use_chosen", "i32"),
        ("keep_scores", "i32"),
    ),
    DECODE_FP8_KERNEL: (
        *_DECODE_CACHE_ARGS,
        ("token_scores", "ptr"),
        *_DECODE_SIZE_ARGS,
        ("softcap", "f32"),
        *_SCORE_OPERAND_ARGS,
        *_DROPOUT_ARGS,
        ("use_chosen", "i32"),
        ("keep_scores", "i32"),
        ("k_scale", "ptr"),  # float32 [num_pages]: each page's K scale
        ("v_scale", "ptr"),
    ),
    "attn_decode_mass": (
        ("token_scores", "ptr"),
        ("lse", "ptr"),
        ("page_table", "ptr"),
        ("page_count", "ptr"),
        ("slot_score", "ptr"),
        ("heads", "i32"),
        ("kv_heads", "i32"),
        ("t_q", "i32"),
        ("page_size", "i32"),
        ("max_pages", "i32"),
    ),
    "attn_decode_gqa": (
        *_DECODE_CACHE_ARGS,
        ("out", "ptr"),
        ("lse", "ptr"),
        ("tickets", "ptr"),  # int32 [batch, kv_heads x row chunks], zeros: counts splits done
        *_DECODE_SIZE_ARGS,
        ("use_chosen", "i32"),
        *_DECODE_GQA_MOD_ARGS,
    ),
    DECODE_GQA_FP8_KERNEL: (
        *_DECODE_CACHE_ARGS,
        ("out", "ptr"),
        ("lse", "ptr"),
        ("tickets", "ptr"),
        *_DECODE_SIZE_ARGS,
        ("use_chosen", "i32"),
        ("k_scale", "ptr"),  # float32 [num_pages]: each page's K scale
        ("v_scale", "ptr"),
        *_DECODE_GQA_MOD_ARGS,
    ),
    "attn_decode_merge": (
        ("part_out", "ptr"),
        ("part_lse", "ptr"),
        ("out", "ptr"),
        ("lse", "ptr"),
        ("rows", "i32"),
        ("splits", "i32"),
    ),
    QUEST_SELECT_KERNEL: (
        ("q", "ptr"),  # [batch, heads, t_q, head_dim], contiguous
        ("key_min", "ptr"),  # [pool rows, head_dim], float32 or bf16: each page's key min
        ("key_max", "ptr"),
        ("page_table", "ptr"),  # int32 [batch, kv_heads, max_pages]
        ("page_count", "ptr"),  # int32 [batch, kv_heads]
        ("bounds", "ptr"),  # float32 [batch, heads, t_q, max_pages]: the workspace
        ("chosen", "ptr"),  # uint8 [batch, heads, t_q, max_pages]
        ("heads", "i32"),
        ("kv_heads", "i32"),
        ("t_q", "i32"),
        ("max_pages", "i32"),
        ("pages_per_split", "i32"),  # table entries a CTA of grid.y bounds
        ("budget_pages", "i32"),  # Quest's pages besides the newest
    ),
    QUEST_ROWS_KERNEL: (
        ("bounds", "ptr"),  # float32 [batch, heads, t_q, max_pages]: every split's bounds
        ("page_count", "ptr"),
        ("chosen", "ptr"),
        ("heads", "i32"),
        ("kv_heads", "i32"),
        ("t_q", "i32"),
        ("max_pages", "i32"),
        ("budget_pages", "i32"),
    ),
    "select_topk": (
        ("scores", "ptr"),
        ("budget", "ptr"),
        ("chosen", "ptr"),
        ("nbq", "i32"),
        ("nb", "i32"),
        ("causal", "i32"),
        ("keep_diagonal", "i32"),
        ("keep_first", "i32"),
    ),
    "select_mass": (
        ("scores", "ptr"),
        ("chosen", "ptr"),
        ("nbq", "i32"),
        ("nb", "i32"),
        ("causal", "i32"),
        ("keep_diagonal", "i32"),
        ("scale", "f64"),
        ("tau", "f64"),
        ("max_blocks", "i32"),
    ),
    "layout_count": (
        ("chosen", "ptr"),
        ("row_count", "ptr"),
        ("col_count", "ptr"),
        ("nbq", "i32"),
        ("nb", "i32"),
    ),
    "layout_scan": (
        ("row_count", "ptr"),
        ("row_ptr", "ptr"),
        ("col_count", "ptr"),
        ("col_ptr", "ptr"),
        ("heads", "i32"),
        ("nbq", "i32"),
        ("nb", "i32"),
    ),
    "layout_fill": (
        ("chosen", "ptr"),
        ("row_ptr", "ptr"),
        ("col_idx", "ptr"),
        ("row_mask", "ptr"),
        ("col_ptr", "ptr"),
        ("row_idx", "ptr"),
        ("col_mask", "ptr"),
        ("entry_of", "ptr"),
        ("nbq", "i32"),
        ("nb", "i32"),
        ("blocksize", "i32"),
        ("n_k", "i32"),
        ("q_offset", "i32"),
        ("causal", "i32"),
        ("capacity", "i32"),
        ("tables", "i32"),
        ("part", "i32"),
    ),
    "mask_vertical_slash": (
        ("row_ptr", "ptr"),
        ("col_idx", "ptr"),
        ("is_vertical", "ptr"),
        ("is_slash", "ptr"),
        ("mask_table", "ptr"),
        ("row_mask", "ptr"),
        ("nbq", "i32"),
        ("n", "i32"),
        ("blocksize", "i32"),
        ("causal", "i32"),
    ),
    "sm90_work_count": (
        ("chosen", "ptr"),
        ("union_count", "ptr"),
        ("nbq", "i32"),
        ("nb", "i32"),
        ("item_rows", "i32"),
        ("tiles", "i32"),
        ("span", "i32"),
    ),
    "sm90_work_scan": (
        ("union_count", "ptr"),
        ("entry_ptr", "ptr"),
        ("slot_ptr", "ptr"),
        ("merge_ptr", "ptr"),
        ("split_tiles", "ptr"),
        ("units", "i32"),
        ("key_tiles", "i32"),
        ("split_factor", "i32"),
        ("split_min_tiles", "i32"),
        ("spread_percent", "i32"),
        ("batch", "i32"),
        ("sms", "i32"),
        ("max_slots", "i32"),  # sm90_split_slots: the launch's partial slots at most
    ),
    "sm90_work_fill": (
        ("chosen", "ptr"),
        ("union_count", "ptr"),
        ("entry_ptr", "ptr"),
        ("entries", "ptr"),
        ("weights", "ptr"),
        ("nbq", "i32"),
        ("nb", "i32"),
        ("item_rows", "i32"),
        ("tiles", "i32"),
        ("span", "i32"),
        ("key_tiles", "i32"),
    ),
    "sm90_work_order": (
        ("entries", "ptr"),
        ("weights", "ptr"),
        ("entry_ptr", "ptr"),
        ("slot_ptr", "ptr"),
        ("merge_ptr", "ptr"),
        ("work_list", "ptr"),
        ("merge_list", "ptr"),
        ("work_counter", "ptr"),
        ("heads", "i32"),
        ("tiles", "i32"),
        ("batch", "i32"),
        ("groups", "i32"),
        ("list_bound", "i32"),
    ),
    "sm90_claim_order": (
        ("col_ptr", "ptr"),
        ("row_idx", "ptr"),
        ("walked", "ptr"),
        ("tile_order", "ptr"),
        ("tile_place", "ptr"),
        ("nb", "i32"),
        ("tiles", "i32"),
        ("key_blocks", "i32"),
        ("kv_group", "i32"),
    ),
    "sm90_dq_ranks": (
        ("row_ptr", "ptr"),
        ("col_idx", "ptr"),
        ("col_ptr", "ptr"),
        ("row_idx", "ptr"),
        ("tile_place", "ptr"),
        ("dq_ranks", "ptr"),
        ("nbq", "i32"),
        ("nb", "i32"),
        ("tiles", "i32"),
        ("key_blocks", "i32"),
        ("kv_group", "i32"),
    ),
    "attn_bwd_dkdv": (
        *_BWD_INPUTS,
        ("dk", "ptr"),
        ("dv", "ptr"),
        *_LAYOUT_ARGS,
        *_RULE_SCALARS,
        # the key bias's gradient per query head: sum over queries of dS (float32 [batch, heads,
        # n_k]), written when use_key_bias_grad
        ("key_bias_grad", "ptr"),
        ("use_key_bias_grad", "i32"),
        *_BWD_STRIDES,
    ),
    "attn_bwd_dq": (
        *_BWD_INPUTS,
        ("dq", "ptr"),
        *_LAYOUT_ARGS,
        *_RULE_SCALARS,
        # ALiBi's slope gradient: per query row, sum over keys of dS * |q_pos - k_pos| (float32
        # [batch, heads, n_q]), written when use_alibi_grad
        ("alibi_grad", "ptr"),
        ("use_alibi_grad", "i32"),
        # the relative-position table's gradient: per query row, dS by table column (float32
        # [batch, heads, n_q, 2M + 1], zeroed), written when use_rel_bias_grad
        ("rel_bias_grad", "ptr"),
        ("use_rel_bias_grad", "i32"),
        # the score bias's gradient: dS of every visited element (float32 [batch, heads, n_q,
        # n_k], zeroed), written when use_score_bias_grad
        ("score_bias_grad", "ptr"),
        ("use_score_bias_grad", "i32"),
        *_BWD_STRIDES,
    ),
}


def _smem_stride(cols: int, itemsize: int) -> int:
    return cols + SMEM_PAD_BYTES // itemsize


# Tile sizes (the one place they are chosen; the C++ traits take them as template arguments).
# Forward: tiles of min(block, FWD_MAX_TILE) query rows and keys with 16 query rows (one mma
# fragment) per warp, except 16-bit 128-blocks (below). Measured on an H100: at 64-blocks this shape
# (the former v1 forward's) was 9-11 % faster on dense causal bf16 at d = 64 and 128 than 32 rows
# per warp in 2 warps (6.62 against 8.25 instructions per HMMA in Nsight; the static model puts
# attn_fwd at this shape at 6.77).
FWD_MAX_TILE = 64
# 16-bit 128-blocks keep 128-row CTAs of 4 warps, 32 rows (two fragments) per warp: each K/V tile
# read through L2 then feeds 128 rows, not 64 (the 64-row forward moved 5.5 TB/s through L2 on the
# H100, near its limit), and each K/V fragment read from shared memory feeds two mma. Not timed on
# a GPU; the static model predicts 1.87 ms against 2.59 for 64-row CTAs (dense causal d = 128,
# T = 8192). fp32 (SIMT FMA: no fragment reuse to gain) keeps 16 rows per warp.
FWD_WIDE_MIN_BLOCK = 128
FWD_WIDE_TILE_M = 128
FWD_WIDE_ROWS_PER_WARP = 32
# With 32 rows per warp, head dims >= 96 take 32-key tiles: the accumulator (2 x HEAD_DIM / 2
# floats per thread) and a 64-key score tile (64 floats) do not fit in 255 registers unspilled
# (ptxas: 56-388 bytes of spills at 64 keys, none at 32); FlashAttention-2 makes the same cut.
FWD_WIDE_TILE_N_LARGE_HEAD = 32
# 16-bit 64-blocks may also run in pairs: one CTA of 8 warps (16 rows each) owns two adjacent query
# blocks and walks the union of their rows, so each K/V tile read through L2 feeds 128 rows, as in
# SDPA-flash, at the 64-row CTA's registers. Chosen per layout by
# backends/kernels.py where the union adds few tiles (dense, causal, windows); head dims up to
# 128 (at 256 the 16-row accumulator already fills the registers).
FWD_PAIRED_BLOCK = 64
FWD_PAIRED_MAX_HEAD_DIM = 128
MMA_ROWS = 16  # rows of one mma fragment
# Backward: each CTA owns BWD_OWN_TILE rows of its own axis (keys of dK/dV, queries of dQ; 16 per
# warp) and steps over the other axis in double-buffered tiles of BWD_STEP_TILE rows; head dims
# 96 and 128 step by 32 so that the dK and dV accumulators (2 x 64 floats per thread) and the
# score tiles fit in registers unspilled.
BWD_OWN_TILE = 64
BWD_STEP_TILE = 64
BWD_STEP_TILE_LARGE_HEAD = 32
BWD_STAGES = 2  # step tiles in shared memory (kernels/attn_bwd.cu BWD_STAGES)
LARGE_HEAD_DIM = 96
# Head dim 256: 16 rows per warp everywhere (a 16 x 256 accumulator is already 128 floats per
# thread), 32-row steps (16 in fp32, whose tiles take twice the shared memory), and dK/dV split
# in two 128-column halves per CTA: both halves' accumulators would need 256 floats per thread.
HUGE_HEAD_DIM = 256
HUGE_HEAD_STEP_TILE = 32
HUGE_HEAD_STEP_TILE_FP32 = 16
HUGE_HEAD_OWN_TILE_FP32 = 32
HUGE_HEAD_DKDV_SPLITS = 2
# The score-modifier variant (softcap, ALiBi, key bias) keeps a few more values per lane than
# the plain kernels; where those sit at the register limit it takes smaller tiles (ptxas on
# sm_80 and sm_90, every instantiation: 8-96 bytes of spill otherwise): the 128-block
# forward at head dims >= 96 runs the 64-row shape of 16 rows per warp; the fp32 forward at head
# dim 256 owns 32 rows (2 warps), as the fp32 backward does; dK/dV steps half as far from head
# dim 80 on (at least 16 rows); both backward kernels step at most MODS_BWD_MAX_STEP rows from
# head dim 16 on (dropout's copy of P for dV, and dQ's tile of softcap slopes, spilled their
# 64-row steps at d48-d80; dK/dV's at d32 with the bitmask rule once dropout's seed could come
# from memory, and at d16 in 16-bit types once a softcap's score was recovered less a dense
# score bias, read again).
MODS_DKDV_HALF_STEP_FROM_HEAD_DIM = 80
# The forward's modifier variant leaves the wide 128 x 64 tile from this head dim on: with the
# score bias's tile code, d80's wide variant spilled 8 bytes on sm_80 at 255 registers.
MODS_NARROW_FWD_FROM_HEAD_DIM = 80
MODS_BWD_CAPPED_STEP_FROM_HEAD_DIM = 16
MODS_BWD_MAX_STEP = 32


def pairs_rows(kernel: str, block: int, head_dim: int, dtype: str) -> bool:
    """Whether an instantiation has a paired forward variant (two query blocks per CTA)."""
    return (
        kernel == "attn_fwd"
        and block == FWD_PAIRED_BLOCK
        and dtype != "float32"
        and head_dim <= FWD_PAIRED_MAX_HEAD_DIM
    )


def tile_sizes(
    kernel: str, block: int, head_dim: int, dtype: str, paired: bool = False, mods: bool = False
) -> tuple[int, int, int]:
    """(tile_m, tile_n, num_warps) of a block kernel: rows per CTA, columns per shared-memory
    tile, warps per CTA. ``paired``: the forward's two-block CTAs (``pairs_rows``); ``mods``:
    the score-modifier variant (its smaller tiles: MODS_DKDV_HALF_STEP_FROM_HEAD_DIM)."""
    own, step, warps = _plain_tile_sizes(kernel, block, head_dim, dtype, paired, mods)
    if mods and kernel == "attn_bwd_dkdv" and head_dim >= MODS_DKDV_HALF_STEP_FROM_HEAD_DIM:
        step = max(step // 2, MMA_ROWS)
    backward = kernel in ("attn_bwd_dkdv", "attn_bwd_dq")
    if mods and backward and head_dim >= MODS_BWD_CAPPED_STEP_FROM_HEAD_DIM:
        step = min(step, MODS_BWD_MAX_STEP)
    return own, step, warps


def _plain_tile_sizes(
    kernel: str, block: int, head_dim: int, dtype: str, paired: bool, mods: bool
) -> tuple[int, int, int]:
    """tile_sizes before the score-modifier variant's halved dK/dV step."""
    if paired:
        assert pairs_rows(kernel, block, head_dim, dtype), (kernel, block, head_dim, dtype)
        return 2 * block, block, 2 * block // MMA_ROWS
    if head_dim == HUGE_HEAD_DIM:
        fp32 = dtype == "float32"
        backward = kernel != "attn_fwd"
        own_tile = (HUGE_HEAD_OWN_TILE_FP32 if fp32 else BWD_OWN_TILE) if backward else FWD_MAX_TILE
        if mods and fp32 and not backward:
            own_tile = HUGE_HEAD_OWN_TILE_FP32
        own = min(block, own_tile)
        step = min(block, HUGE_HEAD_STEP_TILE_FP32 if fp32 and backward else HUGE_HEAD_STEP_TILE)
        return own, step, own // MMA_ROWS
    wide = kernel == "attn_fwd" and dtype != "float32" and block >= FWD_WIDE_MIN_BLOCK
    if wide and not (mods and head_dim >= MODS_NARROW_FWD_FROM_HEAD_DIM):
        tile_n = FWD_WIDE_TILE_N_LARGE_HEAD if head_dim >= LARGE_HEAD_DIM else FWD_MAX_TILE
        return FWD_WIDE_TILE_M, tile_n, FWD_WIDE_TILE_M // FWD_WIDE_ROWS_PER_WARP
    if kernel == "attn_fwd":
        tile = min(block, FWD_MAX_TILE)
        return tile, tile, tile // MMA_ROWS  # 16 query rows per warp
    own = min(block, BWD_OWN_TILE)
    step = min(block, BWD_STEP_TILE_LARGE_HEAD if head_dim >= LARGE_HEAD_DIM else BWD_STEP_TILE)
    return own, step, own // MMA_ROWS  # backward: (own rows, step rows), 16 own rows per warp


class _Launch:
    """What every launch config derives alike from its kernel name and ``threads``: the block,
    the source file and the argument list."""

    kernel: str
    threads: int

    @property
    def block_dims(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

    @property
    def source_file(self) -> str:
        return KERNEL_FILES[self.kernel]

    @property
    def arch(self) -> str | None:
        """The architecture this kernel must be built for, where it is not the device's own
        (CuPy's choice): sm_90a for the wgmma forward."""
        return SM90_ARCH if self.kernel in SM90_KERNELS else None

    @property
    def args(self) -> tuple[tuple[str, str], ...]:
        return KERNEL_ARGS[self.kernel]

    @property
    def group(self) -> tuple:
        """The instantiations the interpreter compiles into one library with this one: those of
        its source file, unless a config says finer."""
        return (self.source_file,)


@dataclass(frozen=True)
class KernelConfig(_Launch):
    """Geometry of one launch of one kernel instantiation.

    ``block`` and ``rule`` are ignored (must be None) for the row kernels, ``mods`` (the
    score-modifier variant) is for the block kernels only, ``paired`` (two query blocks per
    CTA) for the forward where ``pairs_rows`` allows it. ``n_rows`` is the
    length of the axis the grid covers: queries (attn_fwd, attn_bwd_dq, attn_bwd_preprocess) or
    keys (attn_bwd_dkdv); ``heads`` counts query heads.
    """

    kernel: str
    head_dim: int
    dtype: str
    batch: int = 1
    heads: int = 1
    n_rows: int = 1
    block: int | None = None
    rule: str | None = None
    mods: bool = False
    paired: bool = False
    kv_dtype: str | None = None  # the fp8 decode kernels' pages (KV_DTYPES); None elsewhere
    dq_unordered: bool = False  # attn_bwd_sm90 without its dQ semaphores (BWD_DQ_ENV)
    key_pairs: bool = False  # the sm_90a forwards at 64-blocks on 128-key tiles (sm90_key_pairs)
    rescale_skip: bool = False  # the sm_90a forwards' rescale skip (sm90_rescale_skip)
    exp2_poly: bool = False  # the sm_90a forwards' exp2 partly on the FMA pipe (sm90_exp2_poly)
    consumers: int = SM90_CONSUMERS  # attn_fwd_sm90's consumer warpgroups (sm90_consumers)
    tile_m: int = field(init=False)
    tile_n: int = field(init=False)
    splits: int = field(init=False)  # head dim splits of attn_bwd_dkdv (1 elsewhere)
    num_warps: int = field(init=False)
    smem_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        assert self.kernel in KERNEL_FILES, self.kernel
        assert self.head_dim in HEAD_DIMS, self.head_dim
        assert self.dtype in DTYPES, self.dtype
        assert self.batch >= 1 and self.heads >= 1 and self.n_rows >= 1
        assert not self.mods or self.kernel in MODS_KERNELS, self.kernel
        assert not self.dq_unordered or self.kernel in SM90_BWD_KERNELS, self.kernel
        fp8 = self.kernel in (DECODE_FP8_KERNEL, DECODE_GQA_FP8_KERNEL)
        assert (self.kv_dtype in KV_DTYPES) if fp8 else self.kv_dtype is None, self
        assert not fp8 or self.dtype in DECODE_FP8_Q_DTYPES, self
        assert self.kernel != DECODE_GQA_FP8_KERNEL or self.dtype in DECODE_GQA_FP8_Q_DTYPES
        # the element of the shared tiles: the pages' (fp8 codes) or the kernel's dtype
        itemsize = ITEMSIZE[self.kv_dtype or self.dtype]
        half = self.dtype != "float32"
        ld = _smem_stride(self.head_dim, itemsize)
        assert (ld * itemsize) % 16 == 0, "cp.async / ldmatrix rows must stay 16-byte aligned"
        if self.kernel in ROW_KERNELS or self.kernel in SM90_ROW_KERNELS:
            assert self.block is None and self.rule is None
            tile_m = tile_n = ROWS_PER_CTA_ELEMENTWISE
            num_warps = ELEMENTWISE_WARPS
            smem = 0
        elif self.kernel in DECODE_KERNELS:
            # grid (splits = n_rows, kv_heads x row chunks = heads, batch)
            assert self.block is None and self.rule is None
            tile_m = decode_rows_per_cta(self.head_dim)
            tile_n = decode_tile(self.head_dim, self.kv_dtype or self.dtype)
            num_warps = DECODE_WARPS
            # q (float) and each row's query index; the warps' K/V stages, which the final
            # merge of the warps' (acc, m_i, l_i) rows reuses
            q_bytes = tile_m * (self.head_dim + 1) * 4
            stages = DECODE_STAGES * 2 * tile_n * ld * itemsize
            merge = num_warps * tile_m * (self.head_dim + 2) * 4
            smem = q_bytes + max(stages, merge)
        elif self.kernel in DECODE_GQA_KERNELS:
            # grid as attn_decode_split's; [barriers][row masks][stages], the final merge of the
            # consumers' (O, m, l) rows reusing the stages
            assert self.block is None and self.rule is None
            assert decode_gqa_supports(self.head_dim, self.dtype), self
            tile_m = DECODE_GQA_ROWS
            tile_n = (
                decode_gqa_fp8_tile(self.head_dim)
                if fp8
                else decode_gqa_tile(self.head_dim, self.dtype)
            )
            if self.mods:
                tile_n = min(tile_n, DECODE_GQA_MODS_MAX_TILE)
            consumers = DECODE_GQA_CONSUMERS
            two_producers = fp8 and self.head_dim >= DECODE_GQA_FP8_TWO_PRODUCERS_HEAD_DIM
            num_warps = DECODE_GQA_WARPS + (1 if two_producers else 0)
            stages = decode_gqa_stages(tile_n)
            barriers = 2 * stages * DECODE_GQA_BARRIER_BYTES
            masks = stages * tile_n * 4
            if self.mods:  # the modifier variant: a token position beside each row mask
                masks += stages * tile_n * 4
            if self.mods or self.head_dim > DECODE_GQA_WIDE_HEAD_DIM:  # Q's scaled tile
                masks += tile_m * _smem_stride(self.head_dim, ITEMSIZE["float16"]) * 2
            ring = stages * 2 * tile_n * ld * itemsize
            merge = consumers * tile_m * (self.head_dim + 2) * 4
            smem = barriers + masks + max(ring, merge)
            if fp8:  # a K and a V scale a stage's token and its (v_ref, 1 / v_ref); each
                # consumer's widened K and V tiles (fp16)
                wide_ld = _smem_stride(self.head_dim, ITEMSIZE[self.dtype])
                smem += 2 * stages * tile_n * 4 + stages * 2 * 4
                smem += consumers * 2 * tile_n * wide_ld * ITEMSIZE[self.dtype]
        elif self.kernel in SM90_BWD_KERNELS:
            # attn_bwd_sm90: grid (key tiles, kv heads, batch); the persistent one: (CTAs =
            # n_rows, 1, 1), its place hand-over in static shared memory
            assert sm90_backward_supports(self.block, self.head_dim, self.dtype), self
            assert self.rule in RULES and not self.mods and not self.paired, self
            tile_m, tile_n, num_warps = SM90_BWD_TILE_K, SM90_BWD_TILE_Q, SM90_WARPS
            row_bytes = self.head_dim * itemsize
            smem = 2 * tile_m * row_bytes  # K and V
            smem += 2 * SM90_BWD_STAGES * tile_n * row_bytes  # Q and dO stages
            smem += SM90_BWD_DS_STAGES * tile_m * SM90_SWIZZLE_ROW_BYTES  # dS^T
            smem += tile_n * self.head_dim * 4  # the fp32 dQ tile
            smem += 2 * SM90_BWD_STAGES * tile_n * 4  # lse and delta of each stage
            smem += SM90_BWD_BARRIERS * SM90_BARRIER_BYTES + SM90_SWIZZLE_REPEAT_BYTES
        elif self.kernel in SM90_FWD_KERNELS:
            # attn_fwd_sm90: grid (query tiles = n_rows, heads, batch); the persistent one:
            # (CTAs = n_rows, 1, 1)
            assert sm90_forward_supports(self.block, self.head_dim, self.dtype), self
            assert self.kernel == SM90_FWD or self.head_dim in SM90_PERSISTENT_HEAD_DIMS, self
            assert self.rule in RULES and not self.mods and not self.paired, self
            assert not self.key_pairs or sm90_key_pairs_supported(
                self.block, self.head_dim, self.dtype
            ), self
            assert not self.rescale_skip or sm90_rescale_skip_supported(
                self.head_dim, self.key_pairs
            ), self
            assert not self.exp2_poly or sm90_exp2_poly_supported(self.head_dim, self.key_pairs), (
                self
            )
            assert self.consumers == SM90_CONSUMERS or (
                self.kernel == SM90_FWD
                and sm90_consumers_supported(
                    self.block, self.head_dim, self.key_pairs, self.rescale_skip, self.exp2_poly
                )
            ), self
            tile_m, tile_n, num_warps = (
                self.consumers * SM90_CONSUMER_ROWS,
                sm90_tile_n(self.block, self.head_dim, self.key_pairs),
                (1 + self.consumers) * SM90_WARPGROUP_WARPS,
            )
            panels = self.head_dim * itemsize // SM90_SWIZZLE_ROW_BYTES
            kv_rows = SM90_KV_STAGES * 2 * tile_n  # K and V of each stage
            persistent = self.kernel == SM90_FWD_PERSISTENT
            q_buffers = sm90_persistent_q_buffers(self.head_dim) if persistent else 1
            q_rows = q_buffers * tile_m
            smem = panels * (q_rows + kv_rows) * SM90_SWIZZLE_ROW_BYTES
            smem += SM90_BARRIERS * SM90_BARRIER_BYTES + SM90_SWIZZLE_REPEAT_BYTES
            if persistent:
                smem += sm90_persistent_smem_bytes(q_buffers)
        else:
            assert not self.key_pairs and not self.rescale_skip and not self.exp2_poly, self
            assert self.consumers == SM90_CONSUMERS, self
            assert self.block in BLOCK_SIZES, self.block
            assert self.rule in RULES, self.rule
            tile_m, tile_n, num_warps = tile_sizes(
                self.kernel, self.block, self.head_dim, self.dtype, self.paired, self.mods
            )
            if self.kernel == "attn_fwd":
                scratch = 0 if half else 16 * (tile_n + 4)
                smem = (tile_m + 2 * tile_n) * ld * itemsize + num_warps * scratch * 4
            else:
                # backward: two own tiles (K, V or Q, dO), two step tiles per stage
                scratch = 0 if half else 16 * (tile_n + 4)
                smem = (2 * tile_m + BWD_STAGES * 2 * tile_n) * ld * itemsize
                smem += num_warps * scratch * 4
                if self.kernel == "attn_bwd_dkdv":
                    smem += BWD_STAGES * 2 * tile_n * 4  # lse, delta of each stage's queries
            assert self.block % tile_m == 0 or self.paired
            assert tile_m % 16 == 0 and tile_n % 16 == 0
            rows_per_warp = tile_m // num_warps
            assert tile_m % num_warps == 0 and rows_per_warp in (MMA_ROWS, FWD_WIDE_ROWS_PER_WARP)
        huge = self.kernel == "attn_bwd_dkdv" and self.head_dim == HUGE_HEAD_DIM
        object.__setattr__(self, "splits", HUGE_HEAD_DKDV_SPLITS if huge else 1)
        object.__setattr__(self, "tile_m", tile_m)
        object.__setattr__(self, "tile_n", tile_n)
        object.__setattr__(self, "num_warps", num_warps)
        object.__setattr__(self, "smem_bytes", smem)
        limit = SM90_SMEM_LIMIT if self.arch == SM90_ARCH else SM80_SMEM_LIMIT
        assert smem <= limit, f"{self.name_expression}: {smem} bytes shared memory"

    @property
    def threads(self) -> int:
        return self.num_warps * WARP_SIZE

    @property
    def register_cap(self) -> int | None:
        """Registers per thread ptxas may give this instantiation: the ISA's 255, or fewer where
        one CTA of ``threads`` must fit an SM's register file (the attention block kernels,
        whose launch bounds ask for one resident CTA of ``threads``); None for the kernels whose
        launch bounds only their .cu file states."""
        if self.kernel not in BLOCK_KERNELS:
            return None
        per_thread = SM_LIMITS["sm_80"]["registers"] // self.threads
        granule = REGISTER_ALLOCATION_UNIT // WARP_SIZE  # a thread's registers come in 8s
        return min(MAX_REGISTERS_PER_THREAD, per_thread // granule * granule)

    @property
    def grid(self) -> tuple[int, int, int]:
        if self.kernel in ROW_KERNELS or self.kernel in SM90_ROW_KERNELS:
            return (ceil_div(self.n_rows, ROWS_PER_CTA_ELEMENTWISE), self.heads, self.batch)
        if self.kernel == SM90_BWD:  # heads: kv heads; n_rows: keys
            return (ceil_div(self.n_rows, SM90_BWD_TILE_K), self.heads, self.batch)
        if self.kernel == SM90_BWD_PERSISTENT:
            return (self.n_rows, 1, 1)
        if self.kernel in DECODE_KERNELS or self.kernel in DECODE_GQA_KERNELS:
            return (self.n_rows, self.heads, self.batch)
        if self.kernel == SM90_FWD:
            return (ceil_div(self.n_rows, self.tile_m), self.heads, self.batch)
        if self.kernel == SM90_FWD_PERSISTENT:
            return (self.n_rows, 1, 1)
        assert self.block is not None
        num_blocks = ceil_div(self.n_rows, self.block)
        if self.paired:
            return (ceil_div(num_blocks, 2), self.heads, self.batch)
        return (num_blocks * (self.block // self.tile_m) * self.splits, self.heads, self.batch)

    @property
    def group(self) -> tuple:
        """The instantiations the interpreter compiles into one library with this one (the
        modifier variants, the unordered dQ, the rescale skip, the exp2 polynomial, the three
        consumers and the persistent backward apart: only calls that ask build them)."""
        return (
            self.source_file,
            self.dtype,
            self.head_dim,
            self.mods,
            self.kv_dtype,
            self.dq_unordered,
            self.rescale_skip,
            self.exp2_poly,
            self.consumers,
            self.kernel == SM90_BWD_PERSISTENT,
        )

    @property
    def name_expression(self) -> str:
        """C++ name of this instantiation, e.g. ``attn_fwd<64, 64, 64, 4, 128, __half,
        MASK_CAUSAL, MODS_NONE>`` (block, tile_m, tile_n, warps, head dim, type, rule, modifier
        flag) or
        ``attn_bwd_dq<64, 64, 32, 128, ...>`` (block, own tile, step tile, ...)."""
        cxx = CXX_TYPE[self.dtype]
        if self.kernel in ROW_KERNELS or self.kernel in SM90_ROW_KERNELS:
            return f"{self.kernel}<{self.head_dim}, {cxx}>"
        if self.kernel in (DECODE_GQA_KERNEL, DECODE_GQA_FP8_KERNEL):
            return f"{self.kernel}<{self._decode_gqa_args}>"
        mods = CXX_MODS[self.mods]
        if self.kernel == DECODE_FP8_KERNEL:
            assert self.kv_dtype is not None
            kv = KV_CXX_TYPE[self.kv_dtype]
            tiles = f"{self.tile_n}, {self.tile_m}, {self.head_dim}"
            return f"{self.kernel}<{tiles}, {cxx}, {kv}, {mods}>"
        if self.kernel in DECODE_KERNELS:
            return f"{self.kernel}<{self.tile_n}, {self.tile_m}, {self.head_dim}, {cxx}, {mods}>"
        rule = CXX_RULE[self.rule]
        if self.kernel in SM90_FWD_KERNELS:
            # RESCALE_ALWAYS, EXP2_MUFU and two consumers by default
            rescale = ", RESCALE_SKIP" if self.rescale_skip else ""
            if self.exp2_poly:
                rescale = f"{rescale or ', RESCALE_ALWAYS'}, EXP2_POLY"
            if self.consumers != SM90_CONSUMERS:
                rescale = f"{rescale or ', RESCALE_ALWAYS'}"
                rescale = f"{rescale}{'' if self.exp2_poly else ', EXP2_MUFU'}, {self.consumers}"
            return f"{self.kernel}<{self._tile_args}, {self.head_dim}, {cxx}, {rule}{rescale}>"
        if self.kernel in SM90_BWD_KERNELS:
            order = ", DQ_UNORDERED" if self.dq_unordered else ""  # DQ_ORDERED by default
            return f"{self.kernel}<{self._tile_args}, {self.head_dim}, {cxx}, {rule}{order}>"
        return f"{self.kernel}<{self._tile_args}, {self.head_dim}, {cxx}, {rule}, {mods}>"

    @property
    def traits_expression(self) -> str:
        """The C++ traits struct the kernel derives the rest of its geometry from."""
        cxx = CXX_TYPE[self.dtype]
        if self.kernel in ROW_KERNELS or self.kernel in SM90_ROW_KERNELS:
            return f"row_kernel_traits<{self.head_dim}, {cxx}>"
        if self.kernel in DECODE_KERNELS:  # the split kernel's traits, of its pages' type
            kv = KV_CXX_TYPE[self.kv_dtype] if self.kv_dtype else cxx
            return f"attn_decode_split_traits<{self.tile_n}, {self.tile_m}, {self.head_dim}, {kv}>"
        if self.kernel in (DECODE_GQA_KERNEL, DECODE_GQA_FP8_KERNEL):
            return f"{DECODE_GQA_KERNEL}_traits<{self._decode_gqa_traits_args}>"
        if self.consumers != SM90_CONSUMERS:
            return (
                f"{self.kernel}_traits<{self._tile_args}, {self.head_dim}, {cxx}, {self.consumers}>"
            )
        return f"{self.kernel}_traits<{self._tile_args}, {self.head_dim}, {cxx}>"

    @property
    def _decode_gqa_args(self) -> str:
        """The tensor-core decode kernels' template arguments: tile, head dim, q's type, the
        pages' fp8 type for attn_decode_gqa_fp8, the modifier flag."""
        args = f"{self.tile_n}, {self.head_dim}, {CXX_TYPE[self.dtype]}"
        if self.kernel == DECODE_GQA_FP8_KERNEL:
            assert self.kv_dtype is not None
            args = f"{args}, {KV_CXX_TYPE[self.kv_dtype]}"
        return f"{args}, {CXX_MODS[self.mods]}"

    @property
    def _decode_gqa_traits_args(self) -> str:
        """attn_decode_gqa_traits' arguments: tile, head dim, q's type, the pages' type (q's,
        or fp8), the modifier flag."""
        kv = KV_CXX_TYPE[self.kv_dtype] if self.kv_dtype else CXX_TYPE[self.dtype]
        tile = f"{self.tile_n}, {self.head_dim}, {CXX_TYPE[self.dtype]}"
        return f"{tile}, {kv}, {CXX_MODS[self.mods]}"

    @property
    def _tile_args(self) -> str:
        """The leading template arguments of a block kernel: the block and its tiles."""
        if self.kernel == "attn_fwd":
            return f"{self.block}, {self.tile_m}, {self.tile_n}, {self.num_warps}"
        if self.kernel in (*SM90_FWD_KERNELS, *SM90_BWD_KERNELS):
            return f"{self.block}, {self.tile_n}"
        if self.kernel == "attn_bwd_dkdv":
            return f"{self.block}, {self.tile_m}, {self.tile_n}, {self.splits}"
        assert self.kernel == "attn_bwd_dq", self.kernel
        return f"{self.block}, {self.tile_m}, {self.tile_n}"


@dataclass(frozen=True)
class LayoutKernelConfig(_Launch):
    """Geometry of one launch of a layout-construction kernel (kernels/layout_build.cu).

    select_topk / select_mass: ``rows`` query-block rows, one CTA each, ``score_dtype`` the
    scores' type and ``sort_size`` the padded row (``select_sort_size``). layout_count /
    layout_fill: ``rows`` warp units (query-block rows + 32-column strips). layout_scan: two
    CTAs. mask_vertical_slash: ``rows`` query-block rows, one CTA each. ``heads`` is grid.y.
    The schedule kernels (SCHEDULE_KERNELS): ``rows`` warp units (sm90_work_count /
    sm90_work_fill: query tiles; sm90_dq_ranks: query-block rows) or threads (sm90_work_order:
    entries) a grid.y, ``heads`` of grid.y (heads, batch); sm90_work_scan one CTA,
    sm90_claim_order ``rows`` CTAs (kv heads).
    """

    kernel: str
    score_dtype: str | None = None
    sort_size: int | None = None
    rows: int = 1
    heads: int = 1

    def __post_init__(self) -> None:
        assert self.kernel in LAYOUT_BUILD_KERNELS, self.kernel
        assert self.rows >= 1 and self.heads >= 1
        if self.kernel in SELECT_KERNELS:
            assert self.score_dtype in SELECT_SCORE_DTYPES, self.score_dtype
            assert self.sort_size in SELECT_SORT_SIZES, self.sort_size
        else:
            assert self.score_dtype is None and self.sort_size is None
        assert self.smem_bytes <= SM80_SMEM_LIMIT

    @property
    def threads(self) -> int:
        if self.kernel in SELECT_KERNELS:
            assert self.sort_size is not None
            return min(max(self.sort_size // 2, WARP_SIZE), MAX_SELECT_THREADS)
        if self.kernel == "layout_scan" or self.kernel in SCHEDULE_SCAN_KERNELS:
            return SCAN_THREADS
        return INDEX_WARPS * WARP_SIZE

    @property
    def smem_bytes(self) -> int:
        if self.kernel not in SELECT_KERNELS:
            return 0
        assert self.sort_size is not None and self.score_dtype is not None
        return self.sort_size * (np.dtype(self.score_dtype).itemsize + 4)  # keys, int codes

    @property
    def grid(self) -> tuple[int, int, int]:
        if self.kernel in SELECT_KERNELS or self.kernel == "mask_vertical_slash":
            return (self.rows, self.heads, 1)
        if self.kernel == "layout_scan":
            return (SCAN_CTAS, 1, 1)
        if self.kernel == "sm90_work_scan":
            return (1, 1, 1)
        if self.kernel == "sm90_claim_order":
            return (self.rows, 1, 1)
        if self.kernel == "sm90_work_order":
            return (ceil_div(self.rows, INDEX_WARPS * WARP_SIZE), self.heads, 1)
        return (ceil_div(self.rows, INDEX_WARPS), self.heads, 1)

    @property
    def name_expression(self) -> str:
        if self.kernel in SELECT_KERNELS:
            assert self.score_dtype is not None
            return f"{self.kernel}<{SELECT_SCORE_CXX[self.score_dtype]}, {self.sort_size}>"
        return self.kernel

    @property
    def traits_expression(self) -> str:
        if self.kernel in SELECT_KERNELS:
            assert self.score_dtype is not None
            return f"select_traits<{SELECT_SCORE_CXX[self.score_dtype]}, {self.sort_size}>"
        if self.kernel == "layout_scan" or self.kernel in SCHEDULE_SCAN_KERNELS:
            return "layout_scan_traits"
        return "layout_index_traits"


@dataclass(frozen=True)
class DecodeMassConfig(_Launch):
    """Geometry of HeavyHitters' score update (kernels/attn_decode.cu attn_decode_mass): a
    thread per table slot (``slots`` = max_pages x page_size) of each of ``pairs`` (sequence,
    kv head) page tables; not templated."""

    slots: int = 1
    pairs: int = 1
    kernel: str = field(default=DECODE_MASS_KERNEL, init=False)

    def __post_init__(self) -> None:
        assert self.slots >= 1 and self.pairs >= 1

    @property
    def threads(self) -> int:
        return DECODE_MASS_THREADS

    @property
    def smem_bytes(self) -> int:
        return 0

    @property
    def grid(self) -> tuple[int, int, int]:
        return (ceil_div(self.slots, DECODE_MASS_THREADS), self.pairs, 1)

    @property
    def name_expression(self) -> str:
        return self.kernel

    @property
    def traits_expression(self) -> str:
        return f"{self.kernel}_traits"


@dataclass(frozen=True)
class QuestSelectConfig(_Launch):
    """Geometry of Quest's page bounds (and, with one split, choice): kernels/quest_select.cu
    quest_select, a CTA of QUEST_SELECT_WARPS warps per (sequence, kv head) of ``pairs`` and
    split of ``splits``, templated on the head dim, q's dtype and the bounds' ``bound_dtype``;
    its shared memory is a warp's histogram of QUEST_SELECT_BINS int32 each."""

    head_dim: int
    dtype: str
    bound_dtype: str = "float32"
    pairs: int = 1
    splits: int = 1
    kernel: str = field(default=QUEST_SELECT_KERNEL, init=False)

    def __post_init__(self) -> None:
        assert self.head_dim in HEAD_DIMS and self.dtype in DTYPES, self
        assert self.bound_dtype in QUEST_BOUND_DTYPES, self
        assert self.pairs >= 1 and self.splits >= 1

    @property
    def threads(self) -> int:
        return QUEST_SELECT_WARPS * WARP_SIZE

    @property
    def smem_bytes(self) -> int:
        return QUEST_SELECT_WARPS * QUEST_SELECT_BINS * 4

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.pairs, self.splits, 1)

    @property
    def _template(self) -> str:
        types = f"{CXX_TYPE[self.dtype]}, {CXX_TYPE[self.bound_dtype]}"
        return f"<{self.head_dim}, {types}>"

    @property
    def name_expression(self) -> str:
        return f"{self.kernel}{self._template}"

    @property
    def traits_expression(self) -> str:
        return f"{self.kernel}_traits{self._template}"


@dataclass(frozen=True)
class QuestRowsConfig(_Launch):
    """Geometry of Quest's choice over split bounds (kernels/quest_select.cu
    quest_select_rows): a CTA of QUEST_ROWS_WARPS warps per query row of ``rows``; its shared
    memory is the CTA's histogram of QUEST_SELECT_BINS int32 and a spare bin."""

    rows: int = 1
    kernel: str = field(default=QUEST_ROWS_KERNEL, init=False)

    def __post_init__(self) -> None:
        assert self.rows >= 1

    @property
    def threads(self) -> int:
        return QUEST_ROWS_WARPS * WARP_SIZE

    @property
    def smem_bytes(self) -> int:
        return (QUEST_SELECT_BINS + 1) * 4  # and a spare bin for the codes a pass skips

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.rows, 1, 1)

    @property
    def name_expression(self) -> str:
        return self.kernel

    @property
    def traits_expression(self) -> str:
        return f"{self.kernel}_traits"


def quest_resident_ctas(arch: str, multiprocessors: int, head_dim: int) -> int:
    """quest_select CTAs a device of ``multiprocessors`` SMs holds at once: two an SM up to
    head dim 128, one at 256 (the kernel's launch bounds, which ptxas meets without spills)."""
    return multiprocessors * (2 if head_dim < HUGE_HEAD_DIM else 1)


def quest_splits(pairs: int, max_pages: int, resident_ctas: int) -> tuple[int, int]:
    """(splits, pages per split) of quest_select over ``pairs`` page tables of at most
    ``max_pages`` pages: the fewest splits (at most QUEST_MAX_SPLITS, and QUEST_MIN_SPLIT_PAGES
    pages a split at least) whose wave efficiency is within QUEST_WAVE_SLACK of the best. One
    split (no second kernel) wherever the pairs fill the waves nearly as well as any split."""
    pages = max(max_pages, 1)
    pairs = max(pairs, 1)
    most = max(min(QUEST_MAX_SPLITS, pages // QUEST_MIN_SPLIT_PAGES), 1)
    efficiency = {s: wave_efficiency(pairs * s, resident_ctas) for s in range(1, most + 1)}
    best = max(efficiency.values())
    splits = min(s for s, e in efficiency.items() if e >= QUEST_WAVE_SLACK * best)
    per_split = ceil_div(pages, splits)
    return ceil_div(pages, per_split), per_split


def quest_family() -> str:
    """How a GPU chooses Quest's pages, as CUATTN_QUEST asks: "xp" (also when unset: the CuPy
    path of cuattn/serving/decode.py) or "kernel" (quest_select, which has not run on a GPU
    yet). The interpreter always runs quest_select."""
    return _env_choice(QUEST_ENV, QUEST_FAMILIES, QUEST_XP_FAMILY, "Quest page choice")


def select_sort_size(num_blocks: int) -> int:
    """The sort size of a selection over rows of ``num_blocks`` key blocks."""
    for size in SELECT_SORT_SIZES:
        if size >= num_blocks:
            return size
    raise ValueError(
        f"num_blocks: {num_blocks} key blocks per row exceed the {SELECT_SORT_SIZES[-1]} a "
        "selection kernel sorts in shared memory; use a larger blocksize"
    )


def index_units(num_q_blocks: int, num_blocks: int) -> int:
    """Warp units of layout_count / layout_fill: every query-block row, every 32-column strip."""
    return num_q_blocks + ceil_div(num_blocks, WARP_SIZE)


# Per-SM limits of the architectures the kernels compile for (CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability"): registers, threads, resident CTAs, shared
# memory, and the shared memory the system reserves per resident CTA.
SM_LIMITS = {
    "sm_80": {"registers": 65536, "threads": 2048, "ctas": 32, "smem": 167936, "reserved": 1024},
    "sm_90": {"registers": 65536, "threads": 2048, "ctas": 32, "smem": 233472, "reserved": 1024},
}
REGISTER_ALLOCATION_UNIT = 256  # registers are allocated to a warp in units of 256
MAX_REGISTERS_PER_THREAD = 255  # the ISA's limit, sm_80 and sm_90


def ctas_per_sm(arch: str, registers: int, threads: int, smem_bytes: int) -> int:
    """Resident CTAs per SM of a kernel using ``registers`` per thread, ``threads`` per CTA and
    ``smem_bytes`` of shared memory per CTA (static + dynamic): the occupancy the NVRTC report
    shows beside each instantiation's registers."""
    limits = SM_LIMITS[arch]
    warps = ceil_div(threads, WARP_SIZE)
    per_warp = ceil_div(max(registers, 1) * WARP_SIZE, REGISTER_ALLOCATION_UNIT)
    by_registers = limits["registers"] // (per_warp * REGISTER_ALLOCATION_UNIT) // warps
    by_threads = limits["threads"] // (warps * WARP_SIZE)
    by_smem = limits["smem"] // (smem_bytes + limits["reserved"])
    return min(by_registers, by_threads, by_smem, limits["ctas"])


def name_expression(
    kernel: str, head_dim: int, dtype: str, block: int | None = None, rule: str | None = None
) -> str:
    """C++ name of one instantiation (see ``KernelConfig.name_expression``)."""
    return KernelConfig(kernel, head_dim, dtype, block=block, rule=rule).name_expression


def all_configs() -> list[
    KernelConfig | LayoutKernelConfig | DecodeMassConfig | QuestSelectConfig | QuestRowsConfig
]:
    """One config per kernel instantiation (shape-independent fields at their defaults)."""
    configs: list[
        KernelConfig | LayoutKernelConfig | DecodeMassConfig | QuestSelectConfig | QuestRowsConfig
    ] = []
    for kernel in BLOCK_KERNELS:
        for block, head_dim, dtype, rule, mods in itertools.product(
            BLOCK_SIZES, HEAD_DIMS, DTYPES, RULES, CXX_MODS
        ):
            configs.append(KernelConfig(kernel, head_dim, dtype, block=block, rule=rule, mods=mods))
            if pairs_rows(kernel, block, head_dim, dtype):
                configs.append(
                    KernelConfig(
                        kernel, head_dim, dtype, block=block, rule=rule, mods=mods, paired=True
                    )
                )
    for kernel in ROW_KERNELS:
        for head_dim, dtype in itertools.product(HEAD_DIMS, DTYPES):
            configs.append(KernelConfig(kernel, head_dim, dtype))
    for head_dim, dtype, mods in itertools.product(HEAD_DIMS, DTYPES, CXX_MODS):
        configs.append(KernelConfig("attn_decode_split", head_dim, dtype, mods=mods))
    for kernel in SELECT_KERNELS:
        for dtype, size in itertools.product(SELECT_SCORE_DTYPES, SELECT_SORT_SIZES):
            configs.append(LayoutKernelConfig(kernel, dtype, size))
    configs.extend(LayoutKernelConfig(kernel) for kernel in INDEX_KERNELS + SCHEDULE_KERNELS)
    configs.append(DecodeMassConfig())
    configs.extend(
        QuestSelectConfig(head_dim, dtype, bound_dtype)
        for head_dim, dtype, bound_dtype in itertools.product(HEAD_DIMS, DTYPES, QUEST_BOUND_DTYPES)
    )
    configs.append(QuestRowsConfig())
    return configs


def sm90_forward_supports(block: int | None, head_dim: int, dtype: str) -> bool:
    """Whether the sm_90a forward has an instantiation for this block, head dim and dtype."""
    return block in SM90_BLOCKS and head_dim in SM90_HEAD_DIMS and dtype in SM90_DTYPES


def sm90_backward_supports(block: int | None, head_dim: int, dtype: str) -> bool:
    """Whether the sm_90a backward has an instantiation for this block, head dim and dtype."""
    return block in SM90_BWD_BLOCKS and head_dim in SM90_BWD_HEAD_DIMS and dtype in SM90_DTYPES


def sm90_backward_persistent_supports(block: int, head_dim: int, rule: str) -> bool:
    """Whether attn_bwd_sm90_persistent has an instantiation for this block, head dim and rule
    (wherever attn_bwd_sm90 has one, but SM90_BWD_PERSISTENT_SPILLS)."""
    return (block, head_dim, rule) not in SM90_BWD_PERSISTENT_SPILLS


def sm90_backward_configs(kernel: str = SM90_BWD) -> list[KernelConfig]:
    """One config per instantiation of the sm_90a backward (64: blocks x head dims x dtypes x
    rules x the dQ order) and of its dQ conversion (4); ``kernel`` SM90_BWD_PERSISTENT: the
    persistent backward's alone (56: those 64 but SM90_BWD_PERSISTENT_SPILLS'; the conversion
    is the same)."""
    shapes = list(itertools.product(SM90_BWD_HEAD_DIMS, SM90_DTYPES))
    return [
        *[
            KernelConfig(kernel, head_dim, dtype, block=block, rule=rule, dq_unordered=unordered)
            for unordered, block, (head_dim, dtype), rule in itertools.product(
                (False, True), SM90_BWD_BLOCKS, shapes, RULES
            )
            if kernel == SM90_BWD or sm90_backward_persistent_supports(block, head_dim, rule)
        ],
        *[
            KernelConfig(SM90_BWD_DQ, head_dim, dtype)
            for head_dim, dtype in shapes
            if kernel == SM90_BWD
        ],
    ]


def sm90_bwd_key_blocks(block: int) -> int:
    """Key blocks per CTA of the sm_90a backward: its 128 keys are one block or two."""
    return SM90_BWD_TILE_K // block


def sm90_cta_groups(
    batch: int, heads: int, n_k: int, head_dim: int, dtype: str, kv_group: int
) -> int:
    """How many groups attn_fwd_sm90 starts its (head, batch) pairs in, one group after another:
    as few as keep each group's K and V within SM90_L2_GROUP_BYTES (a group of query heads reads
    the kv heads it shares once), at least one pair a group. The kernel sizes them evenly."""
    pairs = batch * heads
    kv_head_bytes = 2 * n_k * head_dim * ITEMSIZE[dtype]
    most = max(1, SM90_L2_GROUP_BYTES * kv_group // max(kv_head_bytes, 1))
    return ceil_div(pairs, most)


def sm90_backward_cta_groups(
    batch: int, kv_heads: int, n_q: int, head_dim: int, dtype: str, kv_group: int
) -> int:
    """How many groups attn_bwd_sm90 claims its (kv head, batch) pairs in, one group after
    another: as few as keep what a group's CTAs share through the L2 within
    SM90_L2_GROUP_BYTES, at least one pair a group. What the CTAs of a pair share is the query
    side of its query heads: Q and dO, lse and delta, and the fp32 dQ accumulator their reduces
    update (a CTA reads only its own keys, once, so K and V are not counted)."""
    pairs = batch * kv_heads
    row_bytes = 2 * head_dim * ITEMSIZE[dtype] + 2 * 4 + head_dim * 4
    pair_bytes = kv_group * n_q * row_bytes
    most = max(1, SM90_L2_GROUP_BYTES // max(pair_bytes, 1))
    return ceil_div(pairs, most)


@dataclass(frozen=True)
class Sm90WorkList:
    """attn_fwd_sm90_persistent's work: ``items`` int32 [entries, SM90_WORK_FIELDS] in the order
    its CTAs claim them (item = pair * query tiles + tile with pair = batch * heads + head, the
    item's key blocks [first, end), its chunk's slot or SM90_NO_SLOT, and those blocks' entries
    in each of its rows), and ``merges`` int32 [split items, SM90_MERGE_FIELDS] (item, first
    slot, chunks: what SM90_FWD_MERGE merges);
    ``split_tiles``, the key tiles above which a row was split (0: none was to be)."""

    items: np.ndarray
    merges: np.ndarray
    split_tiles: int

    @property
    def slots(self) -> int:
        """Partial (out, lse) slots the chunks write."""
        return int(self.merges[:, 2].sum())


def sm90_split_slots(sms: int = SM90_SMS) -> int:
    """The most partial slots a launch over ``sms`` SMs splits its rows into:
    SM90_SPLIT_SLOTS_PER_SM x ``sms``."""
    return SM90_SPLIT_SLOTS_PER_SM * sms


def sm90_chunk_slots(walked: np.ndarray, threshold: int) -> int:
    """Partial slots of the items of one batch (``walked``: their key tiles) split above
    ``threshold``: ceil(walked / threshold) each item walking more."""
    above = walked[walked > threshold]
    return int((-(-above // threshold)).sum())


def sm90_split_tiles(
    walked: np.ndarray, batch: int = 1, sms: int = SM90_SMS, max_slots: int | None = None
) -> int:
    """Key tiles above which a row is split, and the most a chunk walks: SM90_SPLIT_FACTOR x the
    mean item's (``walked``: the key tiles of every item of one batch), at least
    SM90_SPLIT_MIN_TILES; where the launch's items (``batch`` x walked's) are fewer than
    ``sms`` and the longest walks more than SM90_FEW_ITEMS_SPREAD_PERCENT / 100 x the launch's
    walked tiles over ``sms`` (at least SM90_SPLIT_MIN_TILES: the fill), at most the fill.
    Where the launch's chunks would then write more than ``max_slots`` partial slots (None:
    sm90_split_slots(sms)), the lowest threshold above it whose chunks fit: the slots never
    grow with the threshold, so the bisection between it and the longest item's tiles (which
    splits nothing) finds the one threshold layout_build.cu's sm90_work_scan finds."""
    mean = float(walked.mean()) if walked.size else 0.0
    threshold = max(SM90_SPLIT_MIN_TILES, int(np.ceil(SM90_SPLIT_FACTOR * mean)))
    if walked.size and batch * walked.size < sms:
        fill = max(SM90_SPLIT_MIN_TILES, -(-batch * int(walked.sum()) // sms))
        if 100 * int(walked.max()) > SM90_FEW_ITEMS_SPREAD_PERCENT * fill:
            threshold = min(threshold, fill)
    cap = sm90_split_slots(sms) if max_slots is None else max_slots
    if batch * sm90_chunk_slots(walked, threshold) <= cap:
        return threshold
    low, high = threshold, int(walked.max())  # over the cap; splits nothing
    while high - low > 1:
        middle = (low + high) // 2
        if batch * sm90_chunk_slots(walked, middle) <= cap:
            high = middle
        else:
            low = middle
    return high


def sm90_key_span(block: int, key_pairs: bool) -> int:
    """Key blocks of one key tile's walk unit: 2 with key pairs (a 128-key tile of 64-blocks
    2j, 2j + 1), else 1. The work list counts and cuts a row in these units."""
    if key_pairs and block != SM90_KEY_PAIR_BLOCK:
        raise ValueError(f"key_pairs: only at block {SM90_KEY_PAIR_BLOCK}, not {block}")
    return SM90_WIDE_TILE_N // block if key_pairs else 1


def sm90_work_list(
    blocks: np.ndarray,
    batch: int,
    n_k: int,
    head_dim: int,
    dtype: str,
    kv_group: int,
    block: int,
    split_tiles: int | None = None,
    key_pairs: bool = False,
    sms: int = SM90_SMS,
    max_slots: int | None = None,
) -> Sm90WorkList:
    """attn_fwd_sm90_persistent's work list: every (128 query rows, head, batch) item, rows that
    walk more than ``split_tiles`` key tiles (None: sm90_split_tiles over ``sms`` SMs, its
    chunks within ``max_slots`` partial slots, None: sm90_split_slots) cut into
    chunks of their key blocks, in the order its CTAs claim them. ``blocks``: the layout's bool
    [heads, query blocks, key blocks]; ``key_pairs``: the kernel walks 128-key tiles of two
    64-blocks (sm90_key_pairs), so a row is counted in tiles of pairs and cut between pairs.

    A split row's walked key units (sm90_key_span's blocks that the union of its blocks' rows
    holds any of) are cut into ceil(walked / split_tiles) runs of near-equal length; a chunk's
    range reaches to the next chunk's first unit (the first from block 0, the last to the end),
    so the chunks cover the row and no tile is walked by two chunks. The pairs fall into the
    sm90_cta_groups groups attn_fwd_sm90 starts one after another
    (a group's K and V fit the L2 its CTAs share; the first pairs % groups groups hold one pair
    more); within a group the entries go longest first, by the key tiles walked, then by the
    blocks its consumers compute, ties in attn_fwd_sm90's own order (the last rows first, pairs
    ascending, a row's chunks ascending). The longest start first, so the short ones fill the
    SMs at the tail."""
    heads, nbq, nb = blocks.shape
    per_tile = SM90_TILE_M // block  # layout blocks an item owns
    tiles = ceil_div(nbq, per_tile)
    pairs = batch * heads
    if pairs * tiles >= 2**31:
        raise ValueError(
            f"batch x heads x query tiles = {pairs * tiles}: the work list numbers items in 31 bits"
        )
    span = sm90_key_span(block, key_pairs)
    units = ceil_div(nb, span)  # walk units of a row
    owned = np.zeros((heads, tiles * per_tile, nb), dtype=bool)
    owned[:, :nbq] = blocks
    owned = owned.reshape(heads, tiles, per_tile, nb)
    # key tiles of one walk unit
    key_tiles = max(1, span * block // sm90_tile_n(block, head_dim, key_pairs))
    held = np.zeros((heads, tiles, units * span), dtype=bool)
    held[:, :, :nb] = owned.any(axis=2)
    held = held.reshape(heads, tiles, units, span).any(axis=3)  # [heads, tiles, units]
    walked = held.sum(axis=2) * key_tiles  # [heads, tiles]
    if split_tiles is None:
        split_tiles = sm90_split_tiles(walked, batch, sms, max_slots)
    groups = sm90_cta_groups(batch, heads, n_k, head_dim, dtype, kv_group)
    narrow, wide = divmod(pairs, groups)
    # [heads, tiles, rows, key blocks + 1]: a row's entries before each key block
    before = np.zeros((heads, tiles, SM90_ITEM_ROWS, nb + 1), np.int64)
    before[:, :, :per_tile, 1:] = owned.cumsum(axis=3)
    # one row a (head, tile, chunk): head, tile, chunk, first block, end block, walked,
    # computed, then the blocks' entries [first, end) in each of the item's rows
    chunks_of = np.ones_like(walked)
    if split_tiles:
        chunks_of = np.where(walked > split_tiles, -(-walked // split_tiles), 1)
    head_of, tile_of = np.nonzero(chunks_of == 1)
    whole = np.stack(
        [
            head_of,
            tile_of,
            np.full(len(head_of), SM90_NO_SLOT),
            np.zeros(len(head_of), np.int64),
            np.full(len(head_of), nb),
            walked[head_of, tile_of],
            owned.sum(axis=(2, 3))[head_of, tile_of],
            *before[head_of, tile_of][:, :, [0, nb]].reshape(len(head_of), 2 * SM90_ITEM_ROWS).T,
        ],
        axis=1,
    ).reshape(-1, 7 + 2 * SM90_ITEM_ROWS)
    chunked = []
    for head, tile in zip(*np.nonzero(chunks_of > 1), strict=True):
        chunks = int(chunks_of[head, tile])
        keys = np.flatnonzero(held[head, tile])
        cuts = [0, *(int(keys[len(keys) * c // chunks]) for c in range(1, chunks)), units]
        for chunk in range(chunks):
            first, end = cuts[chunk] * span, min(cuts[chunk + 1] * span, nb)
            chunked.append(
                [
                    head,
                    tile,
                    chunk,
                    first,
                    end,
                    int(held[head, tile, cuts[chunk] : cuts[chunk + 1]].sum()) * key_tiles,
                    int(owned[head, tile, :, first:end].sum()),
                    *before[head, tile][:, [first, end]].ravel().tolist(),
                ]
            )
    per_head = np.concatenate(
        [whole, np.asarray(chunked, np.int64).reshape(-1, whole.shape[1])]
    ).astype(np.int64)
    # every batch: the same rows, pair = batch * heads + head
    table = np.tile(per_head, (batch, 1))
    table[:, 0] += np.repeat(np.arange(batch) * heads, len(per_head))
    pair, tile, chunk, first, end, walk, comp = table[:, :7].T
    row_entries = table[:, 7:]
    # the group of each pair: the first `wide` groups hold narrow + 1 pairs
    group = np.where(
        pair < wide * (narrow + 1),
        pair // (narrow + 1),
        wide + (pair - wide * (narrow + 1)) // max(narrow, 1),
    )
    order = np.lexsort((chunk, pair, -tile, -comp, -walk, group))
    item = pair * tiles + tile
    # slots: the split items' chunks in item order, a row's chunks consecutive
    split = chunk != SM90_NO_SLOT
    by_item = np.lexsort((chunk[split], item[split]))
    slot = np.full(len(item), SM90_NO_SLOT, np.int64)
    slot[np.flatnonzero(split)[by_item]] = np.arange(int(split.sum()))
    firsts = split & (chunk == 0)
    split_items, first_slots = item[firsts], slot[firsts]
    merge_order = np.argsort(split_items, kind="stable")
    counts = np.bincount(item[split], minlength=pairs * tiles)[split_items]
    merges = np.stack([split_items, first_slots, counts], axis=1)[merge_order]
    items = np.concatenate([np.stack([item, first, end, slot], axis=1), row_entries], axis=1)
    items = items[order]
    return Sm90WorkList(
        items.astype(np.int32).reshape(-1, SM90_WORK_FIELDS),
        merges.astype(np.int32).reshape(-1, SM90_MERGE_FIELDS),
        split_tiles,
    )


def sm90_tile_n(block: int, head_dim: int, key_pairs: bool = False) -> int:
    """Keys per tile of the sm_90a forward (see SM90_WIDE_TILE_N; key_pairs: 64-blocks in tiles
    of two, SM90_TILE_N_ENV)."""
    wide = (block >= SM90_WIDE_TILE_N or key_pairs) and head_dim <= SM90_WIDE_MAX_HEAD_DIM
    return SM90_WIDE_TILE_N if wide else SM90_TILE_N


def sm90_key_pairs_supported(block: int | None, head_dim: int, dtype: str) -> bool:
    """Whether the sm_90a forwards have a 128-key-tile instantiation at this block (64 only),
    head dim and dtype."""
    return (
        block == SM90_KEY_PAIR_BLOCK
        and head_dim in SM90_KEY_PAIR_HEAD_DIMS
        and dtype in SM90_KEY_PAIR_DTYPES
    )


def sm90_key_pairs(block: int | None, head_dim: int, dtype: str) -> bool:
    """Whether an sm_90a forward runs on 128-key tiles of two 64-blocks: asked for
    (CUATTN_SM90_TILE_N=128; unset or 64: 64-key tiles at 64-blocks, 128-blocks unchanged either
    way) and instantiated (sm90_key_pairs_supported)."""
    asked = _env_choice(SM90_TILE_N_ENV, SM90_TILE_N_CHOICES, str(SM90_TILE_N), "key tile")
    return asked == str(SM90_WIDE_TILE_N) and sm90_key_pairs_supported(block, head_dim, dtype)


def sm90_rescale_skip_supported(head_dim: int, key_pairs: bool = False) -> bool:
    """Whether the sm_90a forwards have a rescale-skip instantiation at this head dim (every
    block and dtype of theirs) and key tiling."""
    return head_dim in SM90_RESCALE_SKIP_HEAD_DIMS and not key_pairs


def sm90_rescale_skip(head_dim: int, key_pairs: bool) -> bool:
    """Whether an sm_90a forward skips O's rescale while the row max grows by at most 2^8:
    asked for (CUATTN_SM90_RESCALE=skip; unset or "always": every tile rescales) and
    instantiated (sm90_rescale_skip_supported)."""
    asked = _env_choice(SM90_RESCALE_ENV, SM90_RESCALE_CHOICES, SM90_RESCALE_ALWAYS, "rescale")
    return asked == SM90_RESCALE_SKIP and sm90_rescale_skip_supported(head_dim, key_pairs)


def sm90_exp2_poly_supported(head_dim: int, key_pairs: bool = False) -> bool:
    """Whether the sm_90a forwards have an exp2-polynomial instantiation at this head dim (every
    block and dtype of theirs, either rescale) and key tiling."""
    return head_dim in SM90_EXP2_POLY_HEAD_DIMS and not key_pairs


def sm90_exp2_poly(head_dim: int, key_pairs: bool) -> bool:
    """Whether an sm_90a forward computes a quarter of its softmax's exp2 by a polynomial on the
    FMA pipe: asked for (CUATTN_SM90_EXP2=poly; unset or "mufu": every exp2 on MUFU) and
    instantiated (sm90_exp2_poly_supported)."""
    asked = _env_choice(SM90_EXP2_ENV, SM90_EXP2_CHOICES, SM90_EXP2_MUFU, "pipe for exp2")
    return asked == SM90_EXP2_POLY and sm90_exp2_poly_supported(head_dim, key_pairs)


def sm90_consumers_supported(
    block: int | None,
    head_dim: int,
    key_pairs: bool = False,
    rescale_skip: bool = False,
    exp2_poly: bool = False,
) -> bool:
    """Whether attn_fwd_sm90 has a three-consumer instantiation here (SM90_CONSUMERS_ENV)."""
    return (
        block == SM90_D64_CONSUMERS_BLOCK
        and head_dim == SM90_D64_CONSUMERS_HEAD_DIM
        and not (key_pairs or rescale_skip or exp2_poly)
    )


def sm90_consumers(
    block: int | None, head_dim: int, key_pairs: bool, rescale_skip: bool, exp2_poly: bool
) -> int:
    """attn_fwd_sm90's consumer warpgroups: 3 where asked for (CUATTN_SM90_D64_CONSUMERS=3;
    unset or 2: two) and instantiated (sm90_consumers_supported), else 2."""
    asked = _env_choice(
        SM90_CONSUMERS_ENV, SM90_CONSUMERS_CHOICES, str(SM90_CONSUMERS), "consumer count"
    )
    wide = asked == str(SM90_D64_CONSUMERS) and sm90_consumers_supported(
        block, head_dim, key_pairs, rescale_skip, exp2_poly
    )
    return SM90_D64_CONSUMERS if wide else SM90_CONSUMERS


def sm90_configs() -> list[KernelConfig]:
    """One config per instantiation of the sm_90a forward (128: blocks x head dims x dtypes x
    rules, then the 128-key tiles of 64-blocks, sm90_key_pairs_supported's x rules, then the
    rescale skip's, sm90_rescale_skip_supported's blocks x head dims x dtypes x rules, then the
    exp2 polynomial's, sm90_exp2_poly_supported's the same way with either rescale, then the
    three consumers', d = 64 at 64-blocks x dtypes x rules)."""
    return [
        *[
            KernelConfig(SM90_FWD, head_dim, dtype, block=block, rule=rule)
            for block, head_dim, dtype, rule in itertools.product(
                SM90_BLOCKS, SM90_HEAD_DIMS, SM90_DTYPES, RULES
            )
        ],
        *[
            KernelConfig(
                SM90_FWD, head_dim, dtype, block=SM90_KEY_PAIR_BLOCK, rule=rule, key_pairs=True
            )
            for head_dim, dtype, rule in itertools.product(
                SM90_KEY_PAIR_HEAD_DIMS, SM90_KEY_PAIR_DTYPES, RULES
            )
        ],
        *[
            KernelConfig(SM90_FWD, head_dim, dtype, block=block, rule=rule, rescale_skip=True)
            for block, head_dim, dtype, rule in itertools.product(
                SM90_BLOCKS, SM90_RESCALE_SKIP_HEAD_DIMS, SM90_DTYPES, RULES
            )
        ],
        *[
            KernelConfig(
                SM90_FWD,
                head_dim,
                dtype,
                block=block,
                rule=rule,
                rescale_skip=skip,
                exp2_poly=True,
            )
            for skip, block, head_dim, dtype, rule in itertools.product(
                (False, True), SM90_BLOCKS, SM90_EXP2_POLY_HEAD_DIMS, SM90_DTYPES, RULES
            )
            if not skip or sm90_rescale_skip_supported(head_dim)
        ],
        *[
            KernelConfig(
                SM90_FWD,
                SM90_D64_CONSUMERS_HEAD_DIM,
                dtype,
                block=SM90_D64_CONSUMERS_BLOCK,
                rule=rule,
                consumers=SM90_D64_CONSUMERS,
            )
            for dtype, rule in itertools.product(SM90_DTYPES, RULES)
        ],
    ]


def sm90_persistent_configs() -> list[KernelConfig]:
    """One config per instantiation of the persistent sm_90a forward (152: sm90_configs') and of
    its chunks' merge (6: head dims x dtypes)."""
    return [
        *[
            KernelConfig(
                SM90_FWD_PERSISTENT,
                c.head_dim,
                c.dtype,
                block=c.block,
                rule=c.rule,
                key_pairs=c.key_pairs,
                rescale_skip=c.rescale_skip,
                exp2_poly=c.exp2_poly,
            )
            for c in sm90_configs()
            if c.head_dim in SM90_PERSISTENT_HEAD_DIMS and c.consumers == SM90_CONSUMERS
        ],
        *[
            KernelConfig(SM90_FWD_MERGE, head_dim, dtype)
            for head_dim, dtype in itertools.product(SM90_PERSISTENT_HEAD_DIMS, SM90_DTYPES)
        ],
    ]


def sm90_persistent_ctas(multiprocessors: int, items: int) -> int:
    """The persistent forward's grid: one CTA an SM (attn_fwd_sm90's 384 threads x 168
    registers fill one), never more than the items."""
    return max(1, min(multiprocessors, items))


def kernel_family() -> str:
    """The forward family CUATTN_KERNELS asks for: "auto" (also when unset: attn_fwd_sm90 where
    the backend runs it by default, on sm_90 GPUs), "mma" (attn_fwd everywhere), "sm90a"
    (attn_fwd_sm90 wherever it applies, the interpreter included) or "sm90a-persistent"
    (attn_fwd_sm90_persistent wherever attn_fwd_sm90 applies). attn_fwd_sm90 applies to
    fp16/bf16, the block sizes and head dims of SM90_*, and no score modifier."""
    return _env_choice(KERNELS_ENV, KERNEL_FAMILIES, AUTO_FAMILY, "kernel family")


def sm90_backward_schedule() -> str:
    """How CUATTN_BWD_SM90 asks attn_bwd_sm90's work to be scheduled: "one-shot" (also when
    unset: attn_bwd_sm90, a CTA an item) or "persistent" (attn_bwd_sm90_persistent: one CTA an
    SM claiming the same items; the same bits)."""
    return _env_choice(BWD_SM90_ENV, BWD_SM90_SCHEDULES, BWD_SM90_ONE_SHOT, "backward schedule")


def sm90_backward_dq_order() -> str:
    """The order CUATTN_BWD_DQ asks of attn_bwd_sm90's dQ reduces: "ordered" (also when unset:
    bit-identical run to run) or "unordered" (no semaphore waits; dQ may differ run to run in
    its last bits)."""
    return _env_choice(BWD_DQ_ENV, BWD_DQ_ORDERS, BWD_DQ_ORDERED, "dQ order")


def _env_choice(variable: str, accepted: tuple[str, ...], unset: str, what: str) -> str:
    """The value of environment ``variable`` (``unset`` where it is unset or empty), one of
    ``accepted``; anything else is a ValueError naming the variable and what it accepts."""
    value = os.environ.get(variable, "") or unset
    if value not in accepted:
        raise ValueError(
            f"{variable}={value!r} is not a {what}; accepted: {', '.join(accepted)} "
            f"(unset: {unset})"
        )
    return value


def _tokens_in(tile_bytes: int, head_dim: int, dtype: str, least: int, most: int) -> int:
    """The power of two of tokens whose K tile (head_dim elements of dtype a token) is about
    ``tile_bytes``: the largest not over it, within [least, most]."""
    tokens = tile_bytes // (head_dim * ITEMSIZE[dtype])
    tokens = 1 << (tokens.bit_length() - 1)
    return min(max(tokens, least), most)


def decode_tile(head_dim: int, dtype: str) -> int:
    """Tokens per decode tile (4 warps' sub-tiles): the power of two whose K tile is about
    DECODE_TILE_BYTES, within [DECODE_MIN_TILE, DECODE_MAX_TILE]."""
    return _tokens_in(DECODE_TILE_BYTES, head_dim, dtype, DECODE_MIN_TILE, DECODE_MAX_TILE)


def decode_rows_per_cta(head_dim: int) -> int:
    """Query rows of one kv group per decode CTA."""
    return DECODE_ROWS_PER_CTA_HUGE_HEAD if head_dim >= HUGE_HEAD_DIM else DECODE_ROWS_PER_CTA


def decode_row_chunks(kv_group: int, t_q: int, head_dim: int) -> int:
    """CTAs along one kv head's query rows (kv_group query heads x t_q queries each)."""
    return ceil_div(kv_group * t_q, decode_rows_per_cta(head_dim))


def decode_splits(ctas: int, max_pages: int, resident_ctas: int) -> tuple[int, int]:
    """(splits, pages per split) of a decode over ``ctas`` (batch x kv heads x row chunks) page
    tables of at most ``max_pages`` pages, for a device that holds ``resident_ctas`` decode CTAs
    at once: enough splits to fill it once (a second, partial wave would cost as much as a full
    one), never more than the pages or DECODE_MAX_SPLITS."""
    wanted = max(resident_ctas // max(ctas, 1), 1)
    splits = max(min(wanted, max_pages, DECODE_MAX_SPLITS), 1)
    per_split = ceil_div(max(max_pages, 1), splits)
    return ceil_div(max(max_pages, 1), per_split), per_split


def decode_resident_ctas(arch: str, multiprocessors: int, head_dim: int, dtype: str) -> int:
    """Decode CTAs a device of ``multiprocessors`` SMs holds at once (``dtype``: the pages',
    an fp8 one for attn_decode_split_fp8, whose q dtype does not change its geometry)."""
    if dtype in KV_DTYPES:
        config = KernelConfig(DECODE_FP8_KERNEL, head_dim, "bfloat16", kv_dtype=dtype)
    else:
        config = KernelConfig("attn_decode_split", head_dim, dtype)
    per_sm = ctas_per_sm(arch, DECODE_REGISTERS_ASSUMED, config.threads, config.smem_bytes)
    return multiprocessors * per_sm


def decode_family() -> str:
    """The decode kernel CUATTN_DECODE asks for: "split" (also when unset: attn_decode_split
    everywhere) or "gqa" (attn_decode_gqa wherever ``decode_gqa_applies``)."""
    return _env_choice(DECODE_ENV, DECODE_FAMILIES, DECODE_SPLIT_FAMILY, "decode kernel family")


def decode_fp8_family() -> str:
    """What CUATTN_DECODE_FP8 asks of fp8 pages on a GPU: "off" (also when unset: refused, as
    attn_decode_split_fp8 has not run on one) or "kernel" (run it)."""
    return _env_choice(
        DECODE_FP8_ENV, DECODE_FP8_FAMILIES, DECODE_FP8_OFF_FAMILY, "fp8 decode choice"
    )


def score_bias_family() -> str:
    """What CUATTN_SCORE_BIAS asks of a dense score bias on a GPU: "off" (also when unset:
    refused, as no GPU has run the kernels' score bias) or "kernel" (run it)."""
    return _env_choice(
        SCORE_BIAS_ENV, DECODE_FP8_FAMILIES, DECODE_FP8_OFF_FAMILY, "score bias choice"
    )


def decode_gqa_supports(head_dim: int, dtype: str) -> bool:
    """Whether attn_decode_gqa has an instantiation for this head dim and dtype (an fp8 one:
    attn_decode_gqa_fp8, for bf16 q)."""
    return head_dim in DECODE_GQA_HEAD_DIMS and dtype in DECODE_GQA_DTYPES + KV_DTYPES


def decode_gqa_applies(head_dim: int, dtype: str) -> bool:
    """Whether a decode runs attn_decode_gqa: asked for (CUATTN_DECODE=gqa) and an
    instantiation exists (fp16/bf16 q, fp8 pages under a bf16 q, DECODE_GQA_HEAD_DIMS: 16 to
    256), with any score modifier, HeavyHitters' per-token scores and any scale
    (decode_gqa_mods says which variant). Otherwise, and by default, attn_decode_split (the
    named fallback: fp32)."""
    wanted = decode_family() == DECODE_GQA_FAMILY
    return wanted and decode_gqa_supports(head_dim, dtype)


def decode_gqa_mods(dtype: str, mods: bool, keep_scores: bool, scale: float) -> bool:
    """Whether attn_decode_gqa runs its MODS_SCORE variant for q of ``dtype``: with a score
    modifier, with HeavyHitters' per-token scores, and in fp16 for a ``scale`` with
    |scale| log2(e) > 1 (the plain kernel holds q scale log2(e) in fp16, which such a scale
    could overflow; the variant scales Q by a power of two into range and S back)."""
    in_range = dtype != "float16" or abs(scale) * DECODE_GQA_LOG2E <= 1.0
    return mods or keep_scores or not in_range


def decode_gqa_tile(head_dim: int, dtype: str) -> int:
    """Tokens per stage of attn_decode_gqa: the power of two whose K tile is about
    DECODE_GQA_TILE_BYTES, within [DECODE_GQA_MIN_TILE, DECODE_GQA_MAX_TILE]."""
    return _tokens_in(
        DECODE_GQA_TILE_BYTES, head_dim, dtype, DECODE_GQA_MIN_TILE, DECODE_GQA_MAX_TILE
    )


def decode_gqa_fp8_tile(head_dim: int) -> int:
    """Tokens per stage of attn_decode_gqa_fp8: half of bf16's attn_decode_gqa tile (at least
    DECODE_GQA_MIN_TILE), doubled back where a tile's 16-byte copies of codes would not divide
    among a warp's lanes (d80)."""
    tile = max(decode_gqa_tile(head_dim, "bfloat16") // 2, DECODE_GQA_MIN_TILE)
    copies = tile * head_dim // ITEMSIZE_OF_COPY
    return tile if copies % WARP_SIZE == 0 else 2 * tile


def decode_gqa_stages(tile: int) -> int:
    """Shared-memory stages of attn_decode_gqa at ``tile`` tokens a stage: the producer reads
    rounds of max(tile, WARP_SIZE) tokens (a token a lane) and the ring holds one round per
    consumer warp, so a 16-token tile (fp8 at d96 and d128) gets two stages a consumer."""
    return DECODE_GQA_CONSUMERS * max(WARP_SIZE // tile, 1)


def decode_gqa_row_chunks(kv_group: int, t_q: int) -> int:
    """CTAs of attn_decode_gqa along one kv head's kv_group x t_q query rows."""
    return ceil_div(kv_group * t_q, DECODE_GQA_ROWS)


def wave_efficiency(ctas: int, resident_ctas: int) -> float:
    """The busy fraction of the waves a grid of ``ctas`` takes on a device holding
    ``resident_ctas`` at once: the last wave's empty slots are lost."""
    return ctas / (resident_ctas * ceil_div(ctas, resident_ctas))


def decode_gqa_splits(ctas: int, max_pages: int, resident_ctas: int) -> tuple[int, int]:
    """(splits, pages per split) of attn_decode_gqa over ``ctas`` (batch x kv heads x row
    chunks) page tables of at most ``max_pages`` pages: the fewest splits (at most
    DECODE_MAX_SPLITS and the pages) whose wave efficiency is within DECODE_GQA_WAVE_SLACK of
    the best, since each split adds a partial to merge."""
    pages = max(max_pages, 1)
    ctas = max(ctas, 1)
    candidates = range(1, min(DECODE_MAX_SPLITS, pages) + 1)
    efficiency = {s: wave_efficiency(ctas * s, resident_ctas) for s in candidates}
    best = max(efficiency.values())
    splits = min(s for s, e in efficiency.items() if e >= DECODE_GQA_WAVE_SLACK * best)
    per_split = ceil_div(pages, splits)
    return ceil_div(pages, per_split), per_split


def decode_gqa_resident_ctas(arch: str, multiprocessors: int, head_dim: int, dtype: str) -> int:
    """attn_decode_gqa CTAs a device of ``multiprocessors`` SMs holds at once."""
    if dtype in KV_DTYPES:
        config = KernelConfig(DECODE_GQA_FP8_KERNEL, head_dim, "bfloat16", kv_dtype=dtype)
    else:
        config = KernelConfig(DECODE_GQA_KERNEL, head_dim, dtype)
    registers = (
        DECODE_GQA_WIDE_REGISTERS_ASSUMED
        if head_dim > DECODE_GQA_WIDE_HEAD_DIM
        else DECODE_GQA_REGISTERS_ASSUMED
    )
    per_sm = ctas_per_sm(arch, registers, config.threads, config.smem_bytes)
    return multiprocessors * per_sm


def decode_fp8_configs() -> list[KernelConfig]:
    """One config per attn_decode_split_fp8 instantiation (head dims x q dtypes x fp8 formats x
    the modifier flag). Kept out of all_configs, as attn_decode_gqa is: fp8 pages are opt-in on
    a GPU, their tests (tests/serving/test_decode_fp8.py) build the libraries they use, and the
    compile check lists them itself."""
    return [
        KernelConfig(DECODE_FP8_KERNEL, head_dim, dtype, mods=mods, kv_dtype=kv_dtype)
        for head_dim, dtype, kv_dtype, mods in itertools.product(
            HEAD_DIMS, DECODE_FP8_Q_DTYPES, KV_DTYPES, CXX_MODS
        )
    ]


def decode_gqa_configs() -> list[KernelConfig]:
    """One config per attn_decode_gqa instantiation (head dims x dtypes x the modifier flag).
    Kept out of all_configs, as the sm_90a forward is: the opt-in kernel's libraries are built
    by its own tests (tests/serving/test_decode_gqa*.py), and the compile check lists it
    itself."""
    return [
        *[
            KernelConfig(DECODE_GQA_KERNEL, head_dim, dtype, mods=mods)
            for head_dim, dtype, mods in itertools.product(
                DECODE_GQA_HEAD_DIMS, DECODE_GQA_DTYPES, CXX_MODS
            )
        ],
        *[
            KernelConfig(DECODE_GQA_FP8_KERNEL, head_dim, dtype, mods=mods, kv_dtype=kv_dtype)
            for head_dim, dtype, kv_dtype, mods in itertools.product(
                DECODE_GQA_HEAD_DIMS, DECODE_GQA_FP8_Q_DTYPES, KV_DTYPES, CXX_MODS
            )
        ],
    ]


def all_instantiations() -> dict[str, list[str]]:
    """Source file -> every name expression it must be compiled for (for the compile CLI)."""
    files: dict[str, list[str]] = {}
    for config in all_configs():
        files.setdefault(config.source_file, []).append(config.name_expression)
    return files


def kernel_dtype(dtype: Any) -> str:
    """The name of ``dtype`` (_util.dtype_name), checked to be one of DTYPES."""
    name = dtype_name(dtype)
    if name not in DTYPES:
        raise TypeError(f"dtype: got {name}, kernels accept {', '.join(DTYPES)}")
    return name
