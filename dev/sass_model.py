"""Static SASS model: what one warp executes per tile of each hot kernel's main loop, no GPU.

For each hot instantiation (``hot_specs``: forward, dK/dV, dQ, decode split; d = 64
and 128; 64- and 128-blocks; bf16, one fp16) this compiles the kernel with NVRTC as ``cuattn
compile`` does plus ``-lineinfo``, disassembles the cubin (dev/sass.py) and counts,
per warp and per tile of the main loop: instructions by class, HMMA, LDSM, shared-memory
wavefronts, barriers, local-memory (spill) accesses. Occupancy comes from ptxas' registers and
geometry's shared memory; dev/sass_roofline.py turns the counts into a time.

How the main loop is found and counted (the attribution rules; each a stated heuristic):
* Loops are natural loops of the converged-path control-flow graph (sass.py). The main loop is
  the deepest loop holding the most of the kernel's work instructions (HMMA; FFMA for the SIMT
  decode kernel).
* Nested loops count ``trips`` times: a loop whose counter runs between constants counts its
  exact trips (sass.counted_trips: e.g. the k-loop ptxas keeps rolled in the forward's QK^T
  at 32 rows per warp, in the 128-row CTAs of fp16/bf16 128-blocks); a
  tile-copy loop (``load_tile_async``, kernels/common/smem.cuh) counts from the copy's chunks
  per thread ``n``: a loop copying ``u`` chunks per iteration runs ``n // u`` times, and of the
  straight-line remainder copies ptxas peels off, ``n % u`` run (at the tile sizes geometry
  chooses, none: those blocks are excluded); the dK/dV step's lse/delta loop ``for (i = tid; i
  < rows; i += threads)`` counts what each warp runs (only the first rows / 32 warps enter it);
  every other loop (the layout walk's ``while`` loops, whose backward branches only skip empty
  or ragged sub-tiles or move to the next entry) counts once.
* Code only partially covered tiles run (``mask_score_frags`` / ``mask_score_tile``, and the
  per-warp ``coverage_of`` of ``narrowed_coverage``) is left out of the per-tile counts and
  reported as the extra cost of a partial (diagonal) tile; in decode, the statements under
  ``if (use_chosen ...)`` and ``if (keep_scores ...)`` (Quest's page choice and HeavyHitters'
  scores, off in a plain decode) are left out. Both are found by source lines: every level of
  an instruction's inline chain is checked against those functions' and statements' lines.
  Other branches inside the loop count both ways (all blocks once): the walk's entry advance,
  ``if (has_next)`` copies, the decode's per-row ``break`` tests at full rows.
* A main-loop iteration holds ``HMMA in it / HMMA per warp-tile`` tiles (the tile shapes fix
  the latter, e.g. 128 for a 16 x 64 x 128 QK^T plus PV); a non-integer ratio is an error, not a
  number. Code of an enclosing loop (e.g. a CSR-entry loop around a sub-tile loop, as the
  removed v1 forward had) counts once per entry, i.e. divided by the sub-tile loop's counted
  trips.
* Code outside the main loop counts once per CTA per warp, its copy loops by the own tile's
  chunks (the first step tile's copy, also outside, is counted as an own tile: a few dozen
  instructions per CTA).
* The sm_90a backward (warp-specialised, wgmma): the work opcode is HGMMA, a tile is one step
  of one consumer warp (``hmma`` is its HGMMA). The else-branch of ``if (tile.coverage !=
  TILE_EMPTY)`` is what a consumer runs for a step it skips; it is counted apart
  (``TileModel.skipped``). The producer's two step loops (the one issuing UTMALDG, the one
  issuing UBLKRED, at the consumers' step-loop depth) count once a step for the CTA
  (``TileModel.producer``) and not once per CTA. HGMMA FLOP and the shared bytes their
  operands read (sass.hgmma_flop, hgmma_shared_bytes) are summed with the counts. In
  attn_bwd_sm90_persistent each role's outermost loop is its item loop: its own code counts
  once an item (the consumers' ``TileModel.per_item``, the producer's two roles'
  ``producer_item``), the loops between it and the step loop as in attn_bwd_sm90, the rest
  once a CTA.
* The sm_90a forward (attn_fwd_sm90, attn_fwd_sm90_persistent): a tile is one key tile of one
  consumer warp, the steady path that issues QK^T(t) with PV(t - 1); an item's first tile and
  a skipped tile are told apart by control flow, the producer's tile loop counts once a step,
  and the persistent grid's item loops once an item (the section "The sm_90a forward" below).
* ``@!PT`` instructions (ptxas pads each LDGSTS with three) count as instructions (they are
  fetched and issued, predicated off) but move no data. The f532ccd calibration cannot tell
  whether ncu counts them: +1..+4 % with them, 0..+2.5 % without.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dev import sass

ARCH = "sm_90"
LINEINFO_OPTION = "-lineinfo"
WARP_SIZE = 32
COPY_BYTES = 16  # one cp.async chunk
COPY_FILE = "smem.cuh"  # load_tile_async: the tile copy whose loops are counted by chunks
STATS_BYTES = 4  # one float of lse or delta
EXIT_OK = 0
EXIT_FAILED = 1
SOURCE_KEY = "from:"  # per-tile counts by origin: "from:smem.cuh", "from:attn_fwd.cu", ...


class AttributionError(RuntimeError):
    """The SASS did not fit the attribution rules (the report says which kernel and why)."""


# ----------------------------------------------------------------------------------------------
# Source regions excluded from the per-tile counts


@dataclass(frozen=True)
class ColdRegion:
    """Source lines the hot path of a full tile does not run.

    kind "function": the body of every function ``name``; "if": every if-statement whose
    condition mentions ``name`` (condition and body); "else": the else-branch of every such
    if-statement; "statement": statements matching ``pattern`` inside function ``name``;
    "loop": every loop statement whose header matches ``pattern`` (header and body).
    ``partial`` marks code that partial tiles run (their extra cost is reported); ``skipped``
    code that a warp runs instead of a tile it skips (counted apart, as the skipped step's
    cost); other regions are features off in the modelled call.
    """

    kind: str
    name: str
    pattern: str = ""
    partial: bool = True
    skipped: bool = False

    @property
    def bucket(self) -> bool | str:
        """Where cold_lines files the region: True (partial), False (off) or SKIPPED."""
        return SKIPPED if self.skipped else self.partial


SKIPPED = "skipped"


PARTIAL_TILE_CODE = (
    ColdRegion("function", "mask_score_frags"),
    ColdRegion("function", "mask_score_tile"),
    # dK/dV's zeroing of rows past n_q: behind a uniform branch taken on a ragged last step only
    ColdRegion("function", "zero_columns_past"),
    # a forward warp's own coverage of a partial tile (walk.cuh's warp_view)
    ColdRegion("statement", "warp_view", r":\s*coverage_of"),
    # the forward's rows whose max score is past SCALE_FOLD_MAX (score_tile.cuh): no model's
    ColdRegion("function", "huge_score_probs", partial=False),
)
# The dK/dV step's lse/delta loads: `for (int i = tid; i < TILE...; i += NUM_THREADS)` over the
# step's query rows, which only the first TILE / 32 warps enter (see _Counter.strided_weight).
STEP_ROW_LOOP = ColdRegion("loop", "", r"for\s*\(\s*int\s+i\s*=\s*tid\s*;", partial=False)
# The sm_90a backward: a consumer whose keys a step does not reach runs the else-branch of
# `if (tile.coverage != TILE_EMPTY)` (dQ_part over the other half, or nothing) instead of the
# step's GEMMs;
# zero_queries_past runs on a ragged last step only.
SM90_BWD_CODE = (
    *PARTIAL_TILE_CODE,
    ColdRegion("function", "zero_queries_past"),
    ColdRegion("else", "TILE_EMPTY", skipped=True),
    # a computing consumer's dQ_part over its own half of dS^T alone (the other consumer skipped
    # the step): once a CTA in a dense causal layout, which the model's call is
    ColdRegion("else", "both_computed", partial=False),
)
# Dropout's generator and mask (kernels/common/philox.cuh): off in the softcap call the
# variant's specs model; the dropout specs count it.
DROPOUT_CODE = (
    ColdRegion("function", "philox4x32_10", partial=False),
    ColdRegion("function", "dropout_frags", partial=False),
    ColdRegion("function", "dropout_tile", partial=False),
)
DECODE_OPTIONAL_CODE = (
    ColdRegion("if", "use_chosen", partial=False),
    ColdRegion("if", "keep_scores", partial=False),
)


def region_lines(text: str, region: ColdRegion) -> list[tuple[int, int]]:
    """(first, last) 1-based line ranges of ``region`` in one source file's text."""
    spans: list[tuple[int, int]] = []
    if region.kind == "function":
        for start, end in _function_bodies(text, region.name):
            spans.append((_line(text, start), _line(text, end)))
    elif region.kind == "if":
        for match in re.finditer(r"\bif\s*\(", text):
            close = _matching(text, match.end() - 1, "(", ")")
            if close is None or not re.search(rf"\b{region.name}\b", text[match.end() : close]):
                continue
            end = _statement_end(text, close + 1)
            spans.append((_line(text, match.start()), _line(text, end)))
    elif region.kind == "else":
        for match in re.finditer(r"\bif\s*\(", text):
            close = _matching(text, match.end() - 1, "(", ")")
            if close is None or not re.search(rf"\b{region.name}\b", text[match.end() : close]):
                continue
            end = _statement_end(text, close + 1)
            branch = re.match(r"\s*else\b", text[end + 1 :])
            if branch is not None:
                start = end + 1 + branch.end()
                spans.append((_line(text, start), _line(text, _statement_end(text, start))))
    elif region.kind == "loop":
        for match in re.finditer(region.pattern, text):
            open_at = text.index("(", match.start())
            close = _matching(text, open_at, "(", ")")
            if close is not None:
                end = _statement_end(text, close + 1)
                spans.append((_line(text, match.start()), _line(text, end)))
    elif region.kind == "statement":
        for start, end in _function_bodies(text, region.name):
            for match in re.finditer(region.pattern, text[start:end]):
                begin = start + match.start()
                spans.append((_line(text, begin), _line(text, text.index(";", begin))))
    else:
        raise ValueError(f"unknown region kind {region.kind!r}")
    return spans


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _matching(text: str, open_at: int, opening: str, closing: str) -> int | None:
    depth = 0
    for n in range(open_at, len(text)):
        if text[n] == opening:
            depth += 1
        elif text[n] == closing:
            depth -= 1
            if depth == 0:
                return n
    return None


def _statement_end(text: str, offset: int) -> int:
    """End of the statement starting at ``offset``: its closing brace, or its semicolon."""
    rest = text[offset:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        brace = offset + len(rest) - len(stripped)
        end = _matching(text, brace, "{", "}")
        return end if end is not None else len(text) - 1
    return text.index(";", offset)


def _function_bodies(text: str, name: str) -> list[tuple[int, int]]:
    """(start, end) offsets of each definition of function ``name``: from its name to its
    closing brace (a call or declaration, not followed by a body, is skipped)."""
    bodies = []
    for match in re.finditer(rf"\b{re.escape(name)}\s*(<[^;{{()]*>)?\s*\(", text):
        close = _matching(text, match.end() - 1, "(", ")")
        if close is None:
            continue
        after = re.match(r"\s*(const\s*)?\{", text[close + 1 :])
        if after is None:
            continue
        brace = close + 1 + after.end() - 1
        end = _matching(text, brace, "{", "}")
        if end is not None:
            bodies.append((match.start(), end))
    return bodies


def cold_lines(
    root: Path, regions: Sequence[ColdRegion]
) -> dict[bool | str, dict[str, list[tuple[int, int]]]]:
    """{bucket (ColdRegion.bucket): {file base name: line ranges}} of ``regions`` in every
    source under root."""
    found: dict[bool | str, dict[str, list[tuple[int, int]]]] = {True: {}, False: {}, SKIPPED: {}}
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".cu", ".cuh") or not path.is_file():
            continue
        text = path.read_text()
        for region in regions:
            spans = region_lines(text, region)
            if spans:
                found[region.bucket].setdefault(path.name, []).extend(spans)
    return found


def _in_regions(inst: sass.Instruction, regions: dict[str, list[tuple[int, int]]]) -> bool:
    return any(
        first <= level.line <= last
        for level in inst.source
        for first, last in regions.get(level.file, ())
    )


# ----------------------------------------------------------------------------------------------
# What is modelled


@dataclass(frozen=True)
class HotSpec:
    """One instantiation and the tile facts the attribution and the roofline need.

    ``hmma_per_warp_tile``: mma.sync one warp issues per tile (0: a SIMT kernel, one tile is
    one main-loop iteration). ``step_rows``: rows of each tile the main loop copies (K/V for
    the forward and dQ, Q/dO for dK/dV, tokens for decode); ``own_rows``: rows of the CTA's own
    tile(s) copied once. ``step_copies``/``own_copies``: how many such tiles. ``stats_rows``:
    floats of lse and delta loaded per step (dK/dV).
    """

    label: str
    kind: str  # "fwd", "dkdv", "dq", "decode", SM90_BWD_KINDS, SM90_FWD_KINDS
    source_file: str
    name_expression: str
    threads: int
    smem_bytes: int
    head_dim: int
    itemsize: int
    block: int
    tile_m: int  # own rows per CTA
    tile_n: int  # step rows per tile
    hmma_per_warp_tile: int
    step_copies: int = 2
    own_copies: int = 1
    stats_per_step: int = 0
    work_opcode: str = "HMMA"
    regions: tuple[ColdRegion, ...] = PARTIAL_TILE_CODE
    strided: tuple[ColdRegion, ...] = (STEP_ROW_LOOP,)
    arch: str = ARCH

    @classmethod
    def of(cls, config: Any, label: str, kind: str, **facts: Any) -> HotSpec:
        """The spec of one geometry.KernelConfig: what the config knows (source, name, threads,
        shared memory, head dim, element size) read from it, the tile ``facts`` given."""
        from cuattn.backends.geometry import ITEMSIZE

        return cls(
            label=label,
            kind=kind,
            source_file=config.source_file,
            name_expression=config.name_expression,
            threads=config.threads,
            smem_bytes=config.smem_bytes,
            head_dim=config.head_dim,
            itemsize=ITEMSIZE[config.dtype],
            **facts,
        )

    @property
    def work_class(self) -> str:
        """The instruction class of work_opcode (HMMA, HGMMA, FP32)."""
        return sass.instruction_class(self.work_opcode)

    @property
    def warps(self) -> int:
        return self.threads // WARP_SIZE

    @property
    def chunks_per_row(self) -> int:
        return self.head_dim * self.itemsize // COPY_BYTES

    def chunks_per_thread(self, rows: int) -> int:
        return -(-rows * self.chunks_per_row // self.threads)

    @property
    def step_bytes(self) -> int:
        """Bytes one CTA reads from L2 per tile (the K/V of the forward and dQ, Q/dO/lse/delta
        of dK/dV)."""
        tile = self.step_copies * self.tile_n * self.head_dim * self.itemsize
        return tile + self.stats_per_step * self.tile_n * STATS_BYTES

    @property
    def own_bytes(self) -> int:
        """Bytes one CTA reads and writes once: its own tiles in, its outputs out."""
        tile = self.tile_m * self.head_dim * self.itemsize
        outputs = {"fwd": 1, "dkdv": 2, "dq": 1}.get(self.kind, 0)
        return (self.own_copies + outputs) * tile


def _geometry_spec(
    label: str,
    kernel: str,
    head_dim: int,
    dtype: str,
    block: int,
    mods: bool = False,
    paired: bool = False,
    regions: tuple[ColdRegion, ...] = PARTIAL_TILE_CODE,
) -> HotSpec:
    from cuattn.backends.geometry import KernelConfig

    config = KernelConfig(
        kernel, head_dim, dtype, block=block, rule="causal", mods=mods, paired=paired
    )
    tile_m, tile_n, warps = config.tile_m, config.tile_n, config.num_warps
    rows_per_warp = tile_m // warps
    m16 = rows_per_warp // 16
    if kernel == "attn_fwd":
        # S = Q K^T (rows x tile_n x d) and O += P V (rows x d x tile_n), one 16x8x16 mma each
        hmma = 2 * m16 * (tile_n // 8) * (head_dim // 16)
        kind, own, stats = "fwd", 1, 0
    elif kernel == "attn_bwd_dkdv":
        # S^T, dP^T (16 x tile_n x d) and dV, dK (16 x d x tile_n) per warp
        hmma = 4 * (tile_n // 8) * (head_dim // 16)
        kind, own, stats = "dkdv", 2, 2
    else:
        # S, dP (16 x tile_n x d) and dQ (16 x d x tile_n) per warp
        hmma = 3 * (tile_n // 8) * (head_dim // 16)
        kind, own, stats = "dq", 2, 0
    return HotSpec.of(
        config,
        label,
        kind,
        block=block,
        tile_m=tile_m,
        tile_n=tile_n,
        hmma_per_warp_tile=hmma,
        own_copies=own,
        stats_per_step=stats,
        regions=regions,
    )


def _decode_spec(head_dim: int, dtype: str) -> HotSpec:
    from cuattn.backends.geometry import KernelConfig

    config = KernelConfig("attn_decode_split", head_dim, dtype)
    tokens_per_warp = config.tile_n // config.num_warps
    return HotSpec.of(
        config,
        f"decode d{head_dim}",
        "decode",
        block=0,
        tile_m=config.tile_m,
        tile_n=tokens_per_warp,  # a warp's sub-tile: the unit of the main loop
        hmma_per_warp_tile=0,
        own_copies=0,
        work_opcode="FFMA",
        regions=DECODE_OPTIONAL_CODE,
    )


SM90_BWD_KIND = "bwd sm90"
SM90_BWD_PERSISTENT_KIND = "bwd sm90 persistent"
SM90_BWD_KINDS = (SM90_BWD_KIND, SM90_BWD_PERSISTENT_KIND)
SM90A_ARCH = "sm_90a"
# The sm_90a backward's producer: the opcodes of the two step loops its warps 0 and 1 run (the
# TMA copies of a step, the dQ reduce of a step).
SM90_PRODUCER_OPCODES = ("UTMALDG", "UBLKRED")


def _sm90_backward_spec(head_dim: int, dtype: str, block: int, kernel: str = "") -> HotSpec:
    """The sm_90a backward (kernels/attn_bwd_sm90.cu): a CTA of 128 keys, two consumer
    warpgroups of 64 keys, a step of 64 queries. HGMMA a consumer warp issues a step: S^T and
    dP^T d / 16 each, dV and dK 4 each, dQ_part 8. ``kernel``: attn_bwd_sm90 (the default) or
    attn_bwd_sm90_persistent, whose CTA loops over items of that CTA's work."""
    from cuattn.backends.geometry import (
        SM90_BWD,
        SM90_BWD_PERSISTENT,
        SM90_BWD_TILE_K,
        SM90_BWD_TILE_Q,
        KernelConfig,
    )

    kernel = kernel or SM90_BWD
    persistent = kernel == SM90_BWD_PERSISTENT
    config = KernelConfig(kernel, head_dim, dtype, block=block, rule="causal")
    k16 = 16  # wgmma's K
    hgmma = 2 * head_dim // k16 + 2 * SM90_BWD_TILE_Q // k16 + SM90_BWD_TILE_K // k16
    name = "bwd sm90a persistent" if persistent else "bwd sm90a"
    return HotSpec.of(
        config,
        f"{name} d{head_dim} b{block}",
        SM90_BWD_PERSISTENT_KIND if persistent else SM90_BWD_KIND,
        block=block,
        tile_m=SM90_BWD_TILE_K,
        tile_n=SM90_BWD_TILE_Q,
        hmma_per_warp_tile=hgmma,
        own_copies=2,
        stats_per_step=2,
        work_opcode="HGMMA",
        regions=SM90_BWD_CODE,
        arch=SM90A_ARCH,
    )


def sm90_backward_specs() -> list[HotSpec]:
    """The sm_90a backward at d = 64/128, 64- and 128-blocks, bf16, causal: attn_bwd_sm90, then
    attn_bwd_sm90_persistent where it has the instantiation."""
    from cuattn.backends.geometry import SM90_BWD_PERSISTENT, sm90_backward_persistent_supports

    return [
        *[
            _sm90_backward_spec(head_dim, HOT_DTYPE, block)
            for head_dim in HOT_HEAD_DIMS
            for block in HOT_BLOCKS
        ],
        *[
            _sm90_backward_spec(head_dim, HOT_DTYPE, block, SM90_BWD_PERSISTENT)
            for head_dim in HOT_HEAD_DIMS
            for block in HOT_BLOCKS
            if sm90_backward_persistent_supports(block, head_dim, "causal")
        ],
    ]


HOT_DTYPE = "bfloat16"
HOT_HEAD_DIMS = (64, 128)
HOT_BLOCKS = (64, 128)


def hot_specs() -> list[HotSpec]:
    """Every hot instantiation: the forward, dK/dV, dQ at d = 64/128 and 64-/128-blocks in bf16;
    the forward d128 b64 in fp16 too; the paired forward (two 64-blocks per CTA) at d = 64/128;
    the three at d128 b64 with a softcap (their MODS_SCORE variants: what the modifier costs)
    and with dropout (the same instantiations, dropout's generator counted);
    decode; the sm_90a backward (sm90_backward_specs); the sm_90a forward
    (sm90_forward_specs)."""
    names = {
        "attn_fwd": "fwd",
        "attn_bwd_dkdv": "dkdv",
        "attn_bwd_dq": "dq",
    }
    specs = []
    for kernel, name in names.items():
        for head_dim in HOT_HEAD_DIMS:
            for block in HOT_BLOCKS:
                label = f"{name} d{head_dim} b{block}"
                specs.append(_geometry_spec(label, kernel, head_dim, HOT_DTYPE, block))
    specs.append(_geometry_spec("fwd d128 b64 fp16", "attn_fwd", 128, "float16", 64))
    for head_dim in HOT_HEAD_DIMS:
        label = f"fwd d{head_dim} b64 paired"
        specs.append(_geometry_spec(label, "attn_fwd", head_dim, HOT_DTYPE, 64, paired=True))
    softcap_call = PARTIAL_TILE_CODE + DROPOUT_CODE
    for kernel, name in names.items():
        label = f"{name} d128 b64 softcap"
        specs.append(_geometry_spec(label, kernel, 128, HOT_DTYPE, 64, True, regions=softcap_call))
    for kernel, name in names.items():
        label = f"{name} d128 b64 dropout"
        specs.append(_geometry_spec(label, kernel, 128, HOT_DTYPE, 64, mods=True))
    specs.extend(_decode_spec(d, HOT_DTYPE) for d in HOT_HEAD_DIMS)
    specs.extend(sm90_backward_specs())
    specs.extend(sm90_forward_specs())
    return specs


# ----------------------------------------------------------------------------------------------
# Compile and count


# The C++ front end's diagnostics in NVRTC's log, not ptxas': e.g. attn_fwd_sm90.cu's constants
# of attn_fwd_sm90_persistent are unreferenced where attn_fwd_sm90 is compiled alone (#177-D),
# and the remark under them.
FRONT_END_DIAGNOSTIC = re.compile(r"\(\d+\): warning #\d+-D:|^Remark: The warnings can be")


@dataclass(frozen=True)
class Compiled:
    spec: HotSpec
    lowered: str
    cubin: bytes
    registers: int
    spill_bytes: int
    static_smem: int
    ptxas_warnings: tuple[str, ...]


def compile_cubin(
    source: str, source_file: str, name_expression: str, options: Sequence[str], arch: str = ARCH
) -> tuple[str, bytes, str]:
    """(lowered name, cubin, ptxas log) of one instantiation: NVRTC with the compile check's
    options plus ``-lineinfo`` (line info only: the code is the same). Raises on an error."""
    lowered, cubin, log = compile_module(source, source_file, [name_expression], options, arch)
    return lowered[name_expression], cubin, log


def compile_module(
    source: str,
    source_file: str,
    name_expressions: Sequence[str],
    options: Sequence[str],
    arch: str = ARCH,
) -> tuple[dict[str, str], bytes, str]:
    """({name expression: lowered name}, cubin, ptxas log): every instantiation in one NVRTC
    program, as compile_cubin compiles one. Raises on an error."""
    from cuattn.backends.toolchain import (
        CUPY_IMPLICIT_OPTIONS,
        PTXAS_VERBOSE_OPTION,
        arch_option,
        nvrtc_cubin,
    )

    all_options = [
        arch_option(arch),
        PTXAS_VERBOSE_OPTION,
        LINEINFO_OPTION,
        *options,
        *CUPY_IMPLICIT_OPTIONS,
    ]
    return nvrtc_cubin(source, source_file, list(name_expressions), all_options)


def compile_spec(spec: HotSpec, source: str, options: Sequence[str], arch: str = ARCH) -> Compiled:
    """One hot instantiation compiled, with its ptxas statistics; raises on a compile error."""
    from dev.ptxas import parse_ptxas_log

    lowered, cubin, log = compile_cubin(
        source, spec.source_file, spec.name_expression, options, arch
    )
    report = parse_ptxas_log(log)
    stats = report.functions.get(lowered)
    if stats is None:
        raise RuntimeError(f"{spec.name_expression}: no ptxas report\n{log}")
    spills = sum(f.spill_store_bytes + f.spill_load_bytes for f in report.functions.values())
    warnings = tuple(
        line.strip()
        for line in log.splitlines()
        if "warning" in line.lower() and not FRONT_END_DIAGNOSTIC.search(line)
    )
    return Compiled(
        spec,
        lowered,
        cubin,
        stats.registers,
        spills,
        stats.static_smem_bytes,
        warnings,
    )


@dataclass
class TileModel:
    """The counts of one instantiation. Per-tile counts are per warp, floats (a loop may hold
    several tiles); ``partial`` is the extra a partially covered tile adds; ``per_cta`` what
    each warp runs once per CTA outside the main loop."""

    spec: HotSpec
    registers: int
    spill_bytes: int
    ctas_per_sm: int
    warps_per_sm: int
    per_tile: dict[str, float]
    partial: dict[str, float]
    per_cta: dict[str, float]
    hmma: float
    ldsm: float
    ld_wavefronts: float
    st_wavefronts: float
    barriers: float
    local_accesses: float
    tiles_per_iteration: int
    ptxas_warnings: tuple[str, ...] = ()
    partial_ld_wavefronts: float = 0.0
    partial_st_wavefronts: float = 0.0
    by_origin: dict[str, float] = field(default_factory=dict)  # instructions per tile by origin
    # wgmma kernels: per warp per tile, the FLOP of its HGMMA and the shared bytes they read
    wgmma_flop: float = 0.0
    wgmma_shared_bytes: float = 0.0
    # what a warp runs for a tile it skips (SKIPPED regions): classes and the extra keys
    skipped: dict[str, float] = field(default_factory=dict)
    # the sm_90a backward's producer: per step, its warps together (SM90_PRODUCER_OPCODES)
    producer: dict[str, float] = field(default_factory=dict)
    # persistent kernels (an item loop around the main loop): what a consumer warp runs once an
    # item outside its main loop, and the producer's warps together once an item outside their
    # step loops; empty where a CTA is an item (``per_cta`` holds that code)
    per_item: dict[str, float] = field(default_factory=dict)
    producer_item: dict[str, float] = field(default_factory=dict)

    @property
    def instructions(self) -> float:
        return sum(self.per_tile.values())

    @property
    def per_hmma(self) -> float:
        return self.instructions / self.hmma if self.hmma else float("nan")

    @property
    def ldsm_per_hmma(self) -> float:
        return self.ldsm / self.hmma if self.hmma else float("nan")

    @property
    def wavefronts_per_hmma(self) -> float:
        return self.ld_wavefronts / self.hmma if self.hmma else float("nan")

    @property
    def l2_bytes_per_hmma(self) -> float:
        per_cta_tile = self.hmma * self.spec.warps
        return self.spec.step_bytes / per_cta_tile if per_cta_tile else float("nan")


def analyse(compiled: Compiled, source_root: Path) -> TileModel:
    """Attribute the disassembled kernel to its main loop by the rules of the module docstring."""
    from cuattn.backends.geometry import WARP_SIZE as GEOMETRY_WARP
    from cuattn.backends.geometry import ctas_per_sm

    spec = compiled.spec
    with tempfile.TemporaryDirectory() as workdir:
        text = sass.disassemble(compiled.cubin, Path(workdir))
    kernels = sass.parse(text)
    if compiled.lowered not in kernels:
        raise AttributionError(f"{spec.label}: {compiled.lowered} not in the disassembly")
    kernel = kernels[compiled.lowered]
    regions = cold_lines(source_root, spec.regions)
    strided = cold_lines(source_root, spec.strided)
    if spec.kind in SM90_FWD_KINDS:
        first_tile = cold_lines(source_root, (SM90_FWD_FIRST_TILE,))[False]
        counter = _Sm90ForwardCounter(kernel, spec, regions, strided, first_tile)
    else:
        counter = _Counter(kernel, spec, regions, strided)
    model = counter.count()
    ctas = ctas_per_sm(
        ARCH, compiled.registers, spec.threads, spec.smem_bytes + compiled.static_smem
    )
    model.registers = compiled.registers
    model.spill_bytes = compiled.spill_bytes
    model.ctas_per_sm = ctas
    model.warps_per_sm = ctas * spec.threads // GEOMETRY_WARP
    model.ptxas_warnings = compiled.ptxas_warnings
    return model


class _Counter:
    """Dynamic counts of one kernel by the attribution rules."""

    def __init__(self, kernel: sass.Kernel, spec: HotSpec, regions, strided) -> None:
        self.kernel = kernel
        self.spec = spec
        self.partial_regions = regions[True]
        self.off_regions = regions[False]
        self.skipped_regions = regions[SKIPPED]
        self.strided_regions = strided[False]

    def strided_weight(self, in_loop: bool) -> float:
        """Executions per warp of code in a thread-strided loop over the step's rows
        (``for (i = tid; i < rows; i += threads)``): warp w runs it ceil((rows - 32 w) /
        threads) times; ptxas peels the first iteration (``in_loop`` False: the share of warps
        that run at least one) and loops over the rest (the mean of the others)."""
        spec = self.spec
        runs = [
            max(0, -(-(spec.tile_n - WARP_SIZE * w) // spec.threads)) for w in range(spec.warps)
        ]
        if in_loop:
            return sum(max(0, r - 1) for r in runs) / spec.warps
        return sum(1 for r in runs if r > 0) / spec.warps

    def _loops_with_parents(self) -> list[tuple[sass.Loop, tuple[sass.Loop, ...]]]:
        out = []

        def visit(loops: Iterable[sass.Loop], parents: tuple[sass.Loop, ...]) -> None:
            for loop in loops:
                out.append((loop, parents))
                visit(loop.children, (*parents, loop))

        visit(self.kernel.loops, ())
        return out

    def _work(self, blocks: Iterable[int]) -> int:
        return sum(
            1 for i in self.kernel.block_instructions(blocks) if i.base == self.spec.work_opcode
        )

    def main_loop(self) -> tuple[sass.Loop, tuple[sass.Loop, ...]]:
        loops = self._loops_with_parents()
        if not loops:
            raise AttributionError(f"{self.spec.label}: no loop in the kernel")
        most = max(self._work(loop.blocks) for loop, _ in loops)
        if most == 0:
            raise AttributionError(f"{self.spec.label}: no {self.spec.work_opcode} in any loop")
        candidates = [(loop, p) for loop, p in loops if self._work(loop.blocks) == most]
        return max(candidates, key=lambda item: item[0].depth)

    def count(self) -> TileModel:
        main, parents = self.main_loop()
        spec = self.spec
        n_step = spec.chunks_per_thread(spec.tile_n)
        hot, partial, skipped = self._count_blocks(main.blocks, main, n_step)
        # attn_bwd_sm90_persistent: the outermost loop around the step loop is the item loop,
        # whose own code (outside the loops it holds) runs once an item; the loops between it
        # and the step loop (the kv group's heads) count as in attn_bwd_sm90
        item_loop = parents[0] if spec.kind == SM90_BWD_PERSISTENT_KIND and parents else None
        if spec.kind == SM90_BWD_PERSISTENT_KIND and item_loop is None:
            raise AttributionError(f"{spec.label}: no item loop around the step loop")
        per_item: dict[str, float] = {}
        if item_loop is not None:
            per_item, _, _ = self._count_blocks(
                item_loop.blocks - _blocks_of_children(item_loop), item_loop, n_step
            )
        # code of enclosing loops runs once per enclosing iteration: per tile, divided by the
        # tiles an enclosing iteration holds (the main loop's counted trips, else 1)
        trips = sass.counted_trips(self.kernel, main) or 1
        for parent in reversed(parents if item_loop is None else parents[1:]):
            extra_hot, extra_partial, _ = self._count_blocks(
                parent.blocks - _blocks_of_children(parent), parent, n_step
            )
            for totals, extra in ((hot, extra_hot), (partial, extra_partial)):
                for key, value in extra.items():
                    totals[key] = totals.get(key, 0.0) + value / trips
            trips *= sass.counted_trips(self.kernel, parent) or 1
        work = spec.work_class
        if spec.hmma_per_warp_tile:
            ratio = hot.get(work, 0.0) / spec.hmma_per_warp_tile
            if ratio < 1 or abs(ratio - round(ratio)) > 1e-6:
                raise AttributionError(
                    f"{spec.label}: {hot.get(work, 0.0):g} {work} per main-loop iteration is not "
                    f"a whole number of {spec.hmma_per_warp_tile}-{work} tiles"
                )
            tiles = round(ratio)
        else:
            tiles = 1
        per_tile = {k: v / tiles for k, v in hot.items()}
        part = {k: v / tiles for k, v in partial.items()}
        outside = set(self.kernel.reachable) - (parents[0].blocks if parents else main.blocks)
        producer: dict[str, float] = {}
        producer_item: dict[str, float] = {}
        if spec.kind in SM90_BWD_KINDS:
            outermost = {id(loop): p[0] if p else loop for loop, p in self._loops_with_parents()}
            for loop in self.producer_loops(main):
                counts, _, _ = self._count_blocks(loop.blocks, loop, n_step)
                _add(producer, counts)
                outside -= loop.blocks
                if item_loop is not None:
                    role_items = outermost[id(loop)]
                    if role_items is loop:
                        raise AttributionError(f"{spec.label}: no item loop around {loop}")
                    counts, _, _ = self._count_blocks(
                        role_items.blocks - loop.blocks, role_items, n_step
                    )
                    _add(producer_item, counts)
                    outside -= role_items.blocks
        cta, _, _ = self._count_blocks(outside, None, spec.chunks_per_thread(spec.tile_m))
        classes = {c: per_tile.get(c, 0.0) for c in sass.CLASSES}
        return TileModel(
            spec=spec,
            registers=0,
            spill_bytes=0,
            ctas_per_sm=0,
            warps_per_sm=0,
            per_tile=classes,
            partial={c: part.get(c, 0.0) for c in sass.CLASSES},
            per_cta={c: cta.get(c, 0.0) for c in sass.CLASSES},
            hmma=per_tile.get(work, 0.0),
            ldsm=per_tile.get("LDSM", 0.0),
            ld_wavefronts=per_tile.get("ld_wavefronts", 0.0),
            st_wavefronts=per_tile.get("st_wavefronts", 0.0),
            barriers=per_tile.get("barriers", 0.0),
            local_accesses=per_tile.get("local", 0.0),
            tiles_per_iteration=tiles,
            partial_ld_wavefronts=part.get("ld_wavefronts", 0.0),
            partial_st_wavefronts=part.get("st_wavefronts", 0.0),
            by_origin={
                k[len(SOURCE_KEY) :]: v for k, v in per_tile.items() if k.startswith(SOURCE_KEY)
            },
            wgmma_flop=per_tile.get("wgmma_flop", 0.0),
            wgmma_shared_bytes=per_tile.get("wgmma_shared_bytes", 0.0),
            skipped={k: v / tiles for k, v in skipped.items() if not k.startswith(SOURCE_KEY)},
            producer={k: v for k, v in producer.items() if not k.startswith(SOURCE_KEY)},
            per_item={c: per_item.get(c, 0.0) for c in sass.CLASSES} if per_item else {},
            producer_item=(
                {c: producer_item.get(c, 0.0) for c in sass.CLASSES} if producer_item else {}
            ),
        )

    def producer_loops(self, main: sass.Loop) -> list[sass.Loop]:
        """The sm_90a backward's producer step loops: for each of SM90_PRODUCER_OPCODES, the
        loop at the consumers' step-loop depth that holds it (its walk's inner loops and the
        one-lane loops ptxas wraps around a uniform TMA instruction count once)."""
        found = []
        for opcode in SM90_PRODUCER_OPCODES:
            loops = [
                loop
                for loop, _ in self._loops_with_parents()
                if loop.depth == main.depth
                and any(i.base == opcode for i in self.kernel.block_instructions(loop.blocks))
            ]
            if len(loops) != 1:
                raise AttributionError(
                    f"{self.spec.label}: {len(loops)} step loops issue {opcode}, not one"
                )
            found.append(loops[0])
        return found

    def _count_blocks(
        self, blocks: Iterable[int], loop: sass.Loop | None, n_chunks: int
    ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """(hot, partial-only, skipped) weighted counts of ``blocks``: the blocks of ``loop``
        not in its children (or, ``loop`` None, the code outside the main loop), nested loops
        weighted by their trips and tile copies by ``n_chunks`` per thread."""
        kernel = self.kernel
        blocks = set(blocks)
        weight = dict.fromkeys(blocks, 1.0)
        nested = list(sass.walk_loops(loop.children)) if loop is not None else []
        if loop is None:  # outside every main-loop ancestor: the top-level loops there
            nested = [
                inner
                for top in kernel.loops
                for inner in sass.walk_loops([top])
                if inner.blocks <= blocks
            ]
        cold_blocks = set()
        copy_loops = set()
        for site_loops, remainder_blocks in self._copy_sites(blocks, nested).values():
            trips, executed = _copy_trips(site_loops, remainder_blocks, n_chunks, kernel)
            for inner, trip in trips.items():
                copy_loops.add(id(inner))
                for b in inner.blocks:
                    if b in weight:
                        weight[b] *= trip
            cold_blocks |= set(remainder_blocks[executed:])
        for inner in nested:
            if id(inner) in copy_loops:
                continue
            trip = sass.counted_trips(kernel, inner)
            if trip is None:
                continue
            for b in inner.blocks:
                if b in weight:
                    weight[b] *= trip
        in_nested: set[int] = set()
        for inner in nested:
            in_nested |= inner.blocks
        hot: Counter = Counter()
        partial: Counter = Counter()
        skipped: Counter = Counter()
        for b in blocks:
            if b in cold_blocks:
                continue
            block = kernel.blocks[b]
            for inst in kernel.instructions[block.first : block.last + 1]:
                if _in_regions(inst, self.off_regions):
                    continue
                w = weight[b]
                if loop is not None and _in_regions(inst, self.strided_regions):
                    w = self.strided_weight(b in in_nested)
                if _in_regions(inst, self.skipped_regions):
                    target = skipped
                elif _in_regions(inst, self.partial_regions):
                    target = partial
                else:
                    target = hot
                target[inst.klass] += w
                target[SOURCE_KEY + self._origin(inst)] += w
                if inst.never_executes:
                    continue  # issued, but moves no data
                target["ld_wavefronts"] += w * sass.shared_load_wavefronts(inst.opcode)
                target["st_wavefronts"] += w * sass.shared_store_wavefronts(inst.opcode)
                target["wgmma_flop"] += w * sass.hgmma_flop(inst.opcode)
                target["wgmma_shared_bytes"] += w * sass.hgmma_shared_bytes(inst)
                if inst.opcode.startswith("BAR.SYNC") or inst.opcode.startswith("BAR.RED"):
                    target["barriers"] += w
                if inst.base in ("LDL", "STL"):
                    target["local"] += w
        return dict(hot), dict(partial), dict(skipped)

    def _origin(self, inst: sass.Instruction) -> str:
        """Where an instruction comes from, as the kernel sees it: the header the kernel's own
        code called into (the level inside the innermost level in the kernel's file), the
        kernel's file for its own lines."""
        for n, level in enumerate(inst.source):
            if level.file == self.spec.source_file:
                return inst.source[n - 1].file if n else level.file
        return inst.source[-1].file if inst.source else "?"

    def _copy_sites(
        self, blocks: set[int], loops: Sequence[sass.Loop]
    ) -> dict[tuple, tuple[list[sass.Loop], list[int]]]:
        """Tile-copy call sites: their loops and their straight-line (remainder) copy blocks
        in address order. A site is the inline chain outside load_tile_async."""
        kernel = self.kernel
        in_loop = set()
        for inner in loops:
            in_loop |= inner.blocks
        sites: dict[tuple, tuple[list[sass.Loop], list[int]]] = {}
        for inner in loops:
            if any(loop_ is not inner and inner.blocks < loop_.blocks for loop_ in loops):
                continue  # only outermost nested loops are copy loops
            body = kernel.block_instructions(inner.blocks)
            if any(i.base == self.spec.work_opcode for i in body):
                continue  # a loop doing the tile's math is no copy loop
            site = self._site_of(body)
            if site is not None:
                sites.setdefault(site, ([], []))[0].append(inner)
        for b in sorted(blocks - in_loop):
            site = self._site_of(kernel.block_instructions([b]))
            if site is not None:
                sites.setdefault(site, ([], []))[1].append(b)
        return sites

    @staticmethod
    def _site_of(instructions: Iterable[sass.Instruction]) -> tuple | None:
        for inst in instructions:
            if inst.base != "LDGSTS":
                continue
            levels = [n for n, level in enumerate(inst.source) if level.file == COPY_FILE]
            if levels:
                return tuple(inst.source[levels[-1] + 1 :])
        return None


def _add(totals: dict[str, float], counts: dict[str, float]) -> None:
    for key, value in counts.items():
        totals[key] = totals.get(key, 0.0) + value


def _blocks_of_children(loop: sass.Loop) -> set[int]:
    out: set[int] = set()
    for child in loop.children:
        out |= child.blocks
    return out


def _copy_trips(
    loops: Sequence[sass.Loop], remainder: Sequence[int], n_chunks: int, kernel: sass.Kernel
) -> tuple[dict[sass.Loop, int], int]:
    """Trips of one copy site's loops and how many of its remainder blocks run, for
    ``n_chunks`` 16-byte copies per thread (see the module docstring)."""
    per_iteration = {
        id(loop): sum(1 for i in kernel.block_instructions(loop.blocks) if i.base == "LDGSTS")
        for loop in loops
    }
    if not loops:
        return {}, n_chunks
    main = max(loops, key=lambda loop: per_iteration[id(loop)])
    unroll = max(per_iteration[id(main)], 1)
    trips = {main: n_chunks // unroll}
    left = n_chunks % unroll
    for loop in loops:
        if loop is not main:
            trips[loop] = left // max(per_iteration[id(loop)], 1)
            left = 0
    return trips, left


# ----------------------------------------------------------------------------------------------
# The sm_90a forward (kernels/attn_fwd_sm90.cu: attn_fwd_sm90 and attn_fwd_sm90_persistent)
#
# Warp-specialised like the sm_90a backward: a producer thread issues the TMA copies, two
# consumer warpgroups own 64 query rows each. A tile is one key tile of one consumer warp: its
# work opcode HGMMA, QK^T (HEAD_DIM / 16 m64nTILE_Nk16, Q and K from shared memory) and PV
# (TILE_N / 16 m64nHEAD_DIMk16, P in registers, V from shared memory). The consumer's tile
# loop holds three paths; the attribution keeps one as the tile:
# * ``if (pending)``: QK^T(t) and PV(t - 1) issued back to back, the softmax of S(t) under PV:
#   every computed tile but an item's first; the tile (``TileModel.per_tile``).
# * its else-branch, QK^T alone: an item's first computed tile. Left out: its PV is issued by
#   the next tile's path or by the ``pv_turn`` after the loop (code once an item), so counting
#   every computed tile as the pending path counts each QK^T and each PV once; what is counted
#   twice is one PV issue an item (the trailing turn's), about 20 instructions a warp.
# * the else-branch of ``if (mine.coverage != TILE_EMPTY)``: a tile the consumer skips (the
#   other block's key tile in a paired 64-block CTA), counted apart (``TileModel.skipped``):
#   its turn, with the previous tile's PV where one is pending (both branches of ``pv_turn``
#   once: its HGMMA are the previous tile's PV, which the tile count already holds).
# The producer's tile loop (the loop at the consumers' tile-loop depth with the most UTMALDG:
# K and V of a tile, 2 x HEAD_DIM / 64 box copies) counts once a step for the CTA
# (``TileModel.producer``). In attn_fwd_sm90_persistent both tile loops sit in an item loop:
# the code of the consumers' item loop outside their tile loop, and of the producer's outside
# its tile loop, counts once an item (``TileModel.per_item``, ``producer_item``), the
# rest once a CTA; in attn_fwd_sm90 a CTA is an item and both are in ``per_cta``.

SM90_FWD_KIND = "fwd sm90"
SM90_FWD_PERSISTENT_KIND = "fwd sm90 persistent"
SM90_FWD_KINDS = (SM90_FWD_KIND, SM90_FWD_PERSISTENT_KIND)
SM90_FWD_PRODUCER_OPCODE = "UTMALDG"
# an item's first computed tile: QK^T alone (see above)
SM90_FWD_FIRST_TILE = ColdRegion("else", "pending", partial=False)
SM90_FWD_CODE = (
    *PARTIAL_TILE_CODE,
    ColdRegion("else", "TILE_EMPTY", skipped=True),
    SM90_FWD_FIRST_TILE,
)
# The rescale skip (RESCALE_SKIP, CUATTN_SM90_RESCALE=skip): the tile counted is one that skips
# O's rescale (the ``if (rescale)`` bodies off: a tile whose max grows by at most the bound in
# every row of the warp, nearly every steady tile once the max settles), its vote counted
SM90_FWD_RESCALE_SKIP_CODE = (*SM90_FWD_CODE, ColdRegion("if", "rescale", partial=False))
WGMMA_M = 64  # query rows of a consumer warpgroup
WGMMA_K = 16


def _sm90_forward_spec(
    kernel: str,
    head_dim: int,
    dtype: str,
    block: int,
    rescale_skip: bool = False,
    exp2_poly: bool = False,
    consumers: int = 2,
) -> HotSpec:
    """attn_fwd_sm90 or attn_fwd_sm90_persistent: a CTA (an item) of 128 query rows, two
    consumer warpgroups of 64; 128-blocks walk 128-key tiles (d <= 128), 64-blocks pair two
    blocks, one a consumer, over 64-key tiles. HGMMA a consumer warp issues a tile: QK^T
    HEAD_DIM / 16, PV TILE_N / 16. rescale_skip: the RESCALE_SKIP instantiation, its tile one
    that skips O's rescale (SM90_FWD_RESCALE_SKIP_CODE); exp2_poly: the EXP2_POLY one (a
    quarter of the softmax's exp2 on the FMA pipe), its tile counted as today's; consumers: 3,
    the CTA of 192 rows (three 64-blocks, CUATTN_SM90_D64_CONSUMERS), its tile counted as
    today's."""
    from cuattn.backends.geometry import SM90_FWD_PERSISTENT, KernelConfig

    config = KernelConfig(
        kernel,
        head_dim,
        dtype,
        block=block,
        rule="causal",
        rescale_skip=rescale_skip,
        exp2_poly=exp2_poly,
        consumers=consumers,
    )
    persistent = kernel == SM90_FWD_PERSISTENT
    name = "fwd sm90a persistent" if persistent else "fwd sm90a"
    if rescale_skip:
        name += " skip"
    if exp2_poly:
        name += " poly"
    if consumers != 2:
        name += f" wg{consumers}"
    return HotSpec.of(
        config,
        f"{name} d{head_dim} b{block}",
        SM90_FWD_PERSISTENT_KIND if persistent else SM90_FWD_KIND,
        block=block,
        tile_m=config.tile_m,
        tile_n=config.tile_n,
        hmma_per_warp_tile=head_dim // WGMMA_K + config.tile_n // WGMMA_K,
        own_copies=1,
        work_opcode="HGMMA",
        regions=SM90_FWD_RESCALE_SKIP_CODE if rescale_skip else SM90_FWD_CODE,
        arch=SM90A_ARCH,
    )


def sm90_forward_specs() -> list[HotSpec]:
    """The sm_90a forward the sweep runs: attn_fwd_sm90 and attn_fwd_sm90_persistent at d =
    64/128, 64- and 128-blocks, bf16, causal; then attn_fwd_sm90's rescale skip at the same and
    its exp2 polynomial at d = 64, then its three consumers (d = 64, 64-blocks)."""
    from cuattn.backends.geometry import (
        SM90_D64_CONSUMERS,
        SM90_D64_CONSUMERS_BLOCK,
        SM90_D64_CONSUMERS_HEAD_DIM,
        SM90_EXP2_POLY_HEAD_DIMS,
        SM90_FWD,
        SM90_FWD_KERNELS,
    )

    variants = [(k, False, False) for k in SM90_FWD_KERNELS]
    variants += [(SM90_FWD, True, False), (SM90_FWD, False, True)]
    return [
        *[
            _sm90_forward_spec(kernel, head_dim, HOT_DTYPE, block, rescale_skip, exp2_poly)
            for kernel, rescale_skip, exp2_poly in variants
            for head_dim in HOT_HEAD_DIMS
            for block in HOT_BLOCKS
            if not exp2_poly or head_dim in SM90_EXP2_POLY_HEAD_DIMS
        ],
        _sm90_forward_spec(
            SM90_FWD,
            SM90_D64_CONSUMERS_HEAD_DIM,
            HOT_DTYPE,
            SM90_D64_CONSUMERS_BLOCK,
            consumers=SM90_D64_CONSUMERS,
        ),
    ]


def _level_in(level: sass.SourceLine, regions: dict[str, list[tuple[int, int]]]) -> bool:
    return any(first <= level.line <= last for first, last in regions.get(level.file, ()))


class _Sm90ForwardCounter(_Counter):
    """The sm_90a forward's counts by the rules of the section's note.

    Source lines alone misplace some of the tile loop's code, so two fix-ups by control flow:
    * An item's first tile (``first_tile``: the lines of the else-branch of ``if (pending)``)
      is the blocks the wgmma issue of that branch dominates, and nothing else. ptxas keeps a
      copy of the softmax for each branch but gives both copies' exponentials the lines of the
      else-branch's call: by lines alone the tile would lose its MUFU.
    * An instruction in no region (ptxas ends some of the wgmma issue's chains at a lambda's
      own line) in a block most of whose instructions a skipped tile runs is a skipped tile's:
      a basic block runs whole."""

    def __init__(
        self,
        kernel: sass.Kernel,
        spec: HotSpec,
        regions,
        strided,
        first_tile: dict[str, list[tuple[int, int]]],
    ) -> None:
        super().__init__(kernel, spec, regions, strided)
        self.first_tile = first_tile
        main, _ = self.main_loop()
        self.kernel = self._settled(main)

    def _settled(self, main: sass.Loop) -> sass.Kernel:
        kernel = self.kernel
        if not self.first_tile or not self.skipped_regions:
            raise AttributionError(
                f"{self.spec.label}: no else-branch of `if (pending)` or of `if (... TILE_EMPTY)`"
                " in the sources"
            )
        seeds = [
            b
            for b in main.blocks
            if any(
                i.base == self.spec.work_opcode and _in_regions(i, self.first_tile)
                for i in kernel.block_instructions([b])
            )
        ]
        first_blocks: set[int] = set()
        for seed in seeds:
            around = sass._reach(kernel.blocks, main.header, avoid=seed)
            first_blocks |= set(main.blocks) - around
        marker = {
            name: (sass.SourceLine(file, spans[0][0]),)
            for name, (file, spans) in (
                ("first", next(iter(self.first_tile.items()))),
                ("skipped", next(iter(self.skipped_regions.items()))),
            )
        }
        instructions = list(kernel.instructions)
        for b in main.blocks:
            block = kernel.blocks[b]
            span = range(block.first, block.last + 1)
            skipped = sum(_in_regions(instructions[n], self.skipped_regions) for n in span)
            for n in span:
                inst = instructions[n]
                source = tuple(
                    level for level in inst.source if not _level_in(level, self.first_tile)
                )
                if b in first_blocks:
                    source += marker["first"]
                elif 2 * skipped > len(span) and not any(
                    _in_regions(inst, r)
                    for r in (self.skipped_regions, self.off_regions, self.partial_regions)
                ):
                    source += marker["skipped"]
                instructions[n] = dataclasses.replace(inst, source=source)
        return sass.Kernel(kernel.name, instructions, dict(kernel.labels))

    def count(self) -> TileModel:
        spec = self.spec
        main, parents = self.main_loop()
        hot, partial, skipped = self._count_blocks(main.blocks, main, 0)
        if abs(hot.get("HGMMA", 0.0) - spec.hmma_per_warp_tile) > 1e-6:
            raise AttributionError(
                f"{spec.label}: {hot.get('HGMMA', 0.0):g} HGMMA in the tile loop's pending path,"
                f" not one tile's {spec.hmma_per_warp_tile}"
            )
        kernel = self.kernel
        consumer_item = parents[-1] if parents else None
        producer = self._producer_loop(main)
        producer_parent = next(
            (
                loop
                for loop, _ in self._loops_with_parents()
                if producer in loop.children and loop is not consumer_item
            ),
            None,
        )
        per_item: dict[str, float] = {}
        producer_item: dict[str, float] = {}
        if consumer_item is not None:
            per_item, _, _ = self._count_blocks(
                consumer_item.blocks - main.blocks, consumer_item, 0
            )
        if producer_parent is not None:
            producer_item, _, _ = self._count_blocks(
                producer_parent.blocks - producer.blocks, producer_parent, 0
            )
        tile_producer, _, _ = self._count_blocks(producer.blocks, producer, 0)
        tile_producer[SM90_FWD_PRODUCER_OPCODE] = sum(
            1
            for i in kernel.block_instructions(producer.blocks)
            if i.base == SM90_FWD_PRODUCER_OPCODE and not i.never_executes
        )
        outside = set(kernel.reachable) - (parents[0].blocks if parents else main.blocks)
        outside -= producer_parent.blocks if producer_parent is not None else producer.blocks
        cta, _, _ = self._count_blocks(outside, None, 0)

        def classes(counts: dict[str, float]) -> dict[str, float]:
            return {c: counts.get(c, 0.0) for c in sass.CLASSES}

        def extras(counts: dict[str, float]) -> dict[str, float]:
            return {k: v for k, v in counts.items() if not k.startswith(SOURCE_KEY)}

        return TileModel(
            spec=spec,
            registers=0,
            spill_bytes=0,
            ctas_per_sm=0,
            warps_per_sm=0,
            per_tile=classes(hot),
            partial=classes(partial),
            per_cta=classes(cta),
            hmma=hot.get("HGMMA", 0.0),
            ldsm=hot.get("LDSM", 0.0),
            ld_wavefronts=hot.get("ld_wavefronts", 0.0),
            st_wavefronts=hot.get("st_wavefronts", 0.0),
            barriers=hot.get("barriers", 0.0),
            local_accesses=hot.get("local", 0.0),
            tiles_per_iteration=1,
            partial_ld_wavefronts=partial.get("ld_wavefronts", 0.0),
            partial_st_wavefronts=partial.get("st_wavefronts", 0.0),
            by_origin={k[len(SOURCE_KEY) :]: v for k, v in hot.items() if k.startswith(SOURCE_KEY)},
            wgmma_flop=hot.get("wgmma_flop", 0.0),
            wgmma_shared_bytes=hot.get("wgmma_shared_bytes", 0.0),
            skipped=extras(skipped),
            producer=extras(tile_producer),
            per_item=classes(per_item),
            producer_item=classes(producer_item),
        )

    def main_loop(self) -> tuple[sass.Loop, tuple[sass.Loop, ...]]:
        """The consumers' tile loop: the deepest loop holding HGMMA (in attn_fwd_sm90_persistent
        the item loop around it holds more: the trailing PV)."""
        loops = [(loop, p) for loop, p in self._loops_with_parents() if self._work(loop.blocks)]
        if not loops:
            raise AttributionError(f"{self.spec.label}: no HGMMA in any loop")
        return max(loops, key=lambda item: (item[0].depth, self._work(item[0].blocks)))

    def _producer_loop(self, main: sass.Loop) -> sass.Loop:
        """The producer's tile loop: at the consumers' tile-loop depth, the most UTMALDG (the
        one-lane loops ptxas wraps around each TMA copy hold one; Q's lie outside it)."""

        def copies(loop: sass.Loop) -> int:
            body = self.kernel.block_instructions(loop.blocks)
            return sum(1 for i in body if i.base == SM90_FWD_PRODUCER_OPCODE)

        loops = [loop for loop, _ in self._loops_with_parents() if loop.depth == main.depth]
        loops = [loop for loop in loops if loop is not main and copies(loop)]
        if not loops:
            raise AttributionError(f"{self.spec.label}: no producer loop issues UTMALDG")
        return max(loops, key=copies)


# ----------------------------------------------------------------------------------------------
# Running the hot set


def _analyse_job(args: tuple[HotSpec, str, tuple[str, ...], str]) -> TileModel | str:
    spec, source, options, root = args
    try:
        return analyse(compile_spec(spec, source, options, spec.arch), Path(root))
    except (RuntimeError, FileNotFoundError, AttributionError) as exc:
        return f"{spec.label}: {exc}"


def model_specs(
    specs: Sequence[HotSpec],
    sources: dict[str, str],
    options: Sequence[str],
    source_root: Path,
    jobs: int = 1,
) -> list[TileModel]:
    """Compile and count every spec (in ``jobs`` processes); raises on the first failure."""
    tasks = [(s, sources[s.source_file], tuple(options), str(source_root)) for s in specs]
    if jobs <= 1:
        results = [_analyse_job(task) for task in tasks]
    else:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            results = list(pool.map(_analyse_job, tasks))
    failures = [r for r in results if isinstance(r, str)]
    if failures:
        raise AttributionError("\n".join(failures))
    return [r for r in results if isinstance(r, TileModel)]


def current_sources(specs: Iterable[HotSpec]) -> dict[str, str]:
    from cuattn.backends.toolchain import kernel_program

    return {name: kernel_program(name) for name in {s.source_file for s in specs}}


def missing_tools() -> str | None:
    """What this machine lacks for the model, in one line; None when nothing."""
    from dev.compile_check import missing_toolchain

    problem = missing_toolchain()
    if problem is not None:
        return problem
    if sass.find_nvdisasm() is None:
        return f"nvdisasm not found; {sass.NVDISASM_INSTALL_HINT}"
    return None


# ----------------------------------------------------------------------------------------------
# Report and baseline

BASELINE_KEYS = ("instructions_per_hmma", "ldsm_per_hmma", "wavefronts_per_hmma")


def baseline_entry(model: TileModel) -> dict:
    """What the regression test compares: per-HMMA ratios (per tile for decode), registers,
    spills."""
    spec = model.spec
    entry = {
        "name_expression": spec.name_expression,
        "instructions_per_tile": round(model.instructions, 1),
        "registers": model.registers,
        "spill_bytes": model.spill_bytes,
    }
    if spec.hmma_per_warp_tile:
        entry["instructions_per_hmma"] = round(model.per_hmma, 3)
        entry["ldsm_per_hmma"] = round(model.ldsm_per_hmma, 4)
        entry["wavefronts_per_hmma"] = round(model.wavefronts_per_hmma, 4)
    return entry


def format_counts_table(
    models: Sequence[TileModel],
    times: dict[str, float] | None = None,
    references: Sequence[dict] = (),
) -> str:
    """Markdown: one row per instantiation, per warp per tile of the main loop; ``references``
    (SDPA-flash from its profile) add rows with the figures a profile gives."""
    header = (
        "| instantiation | tile (own x step), warps | HMMA | instr | instr/HMMA | LDSM/HMMA"
        " | wavefronts/HMMA | LDSM | LDGSTS | BAR | MUFU | FP32 | INT | uniform | control | other"
        " | barriers/tile | L2 B/HMMA | regs | spill B | CTAs x warps/SM | predicted ms |"
        "\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
        "|---:|---:|---:|---|---:|"
    )
    rows = [header]
    for m in models:
        s = m.spec
        c = m.per_tile
        per = (
            (f"{m.per_hmma:.2f}", f"{m.ldsm_per_hmma:.3f}", f"{m.wavefronts_per_hmma:.2f}")
            if s.hmma_per_warp_tile
            else ("-", "-", "-")
        )
        l2 = f"{m.l2_bytes_per_hmma:.0f}" if s.hmma_per_warp_tile else "-"
        predicted = (times or {}).get(s.label)
        rows.append(
            f"| {s.label} `{s.name_expression}` | {s.tile_m} x {s.tile_n}, {s.warps}"
            f" | {m.hmma:.0f} | {m.instructions:.0f} | {per[0]} | {per[1]} | {per[2]}"
            f" | {c['LDSM']:.0f} | {c['LDGSTS']:.0f} | {c['BAR']:.0f} | {c['MUFU']:.0f}"
            f" | {c['FP32']:.0f} | {c['INT']:.0f} | {c['uniform']:.0f} | {c['control']:.0f}"
            f" | {c['other'] + c['LDS/STS']:.0f} | {m.barriers:.0f} | {l2} | {m.registers}"
            f" | {m.spill_bytes} | {m.ctas_per_sm} x {m.warps_per_sm}"
            f" | {'-' if predicted is None else f'{predicted:.3f}'} |"
        )
    for r in references:
        rows.append(
            f"| {r['label']} | {r['tile']} | {r['hmma']:.0f} | {r['instructions']:.0f}"
            f" | {r['per_hmma']:.2f} | {r['ldsm_per_hmma']:.3f} | {r['wavefronts_per_hmma']:.2f}"
            f" | - | - | - | - | - | - | - | - | - | - | {r['l2_per_hmma']:.0f} | {r['registers']}"
            f" | 0 | {r['occupancy']} | - |"
        )
    return "\n".join(rows)


ORIGINS = (
    ("kernel's own lines (softmax, dS, stores)", None),
    ("smem.cuh (tile copies)", "smem.cuh"),
    ("warp_gemm.cuh (ldmatrix, mma, quad reductions)", "warp_gemm.cuh"),
    ("walk.cuh (layout walk)", "walk.cuh"),
    ("score_tile.cuh (scale, masks)", "score_tile.cuh"),
)


def format_origin_table(models: Sequence[TileModel]) -> str:
    """Markdown: instructions per warp per tile by where they come from (the kernel's own lines
    or the header it called: the levers of issue #26 part 2 are in these columns)."""
    columns = [name for name, _ in ORIGINS] + ["other headers"]
    rows = [
        "| instantiation | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for m in models:
        origin = dict(m.by_origin)
        cells = [origin.pop(m.spec.source_file, 0.0)]
        for _, header in ORIGINS[1:]:
            cells.append(origin.pop(header, 0.0))
        cells.append(sum(origin.values()))
        rows.append(f"| {m.spec.label} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    return "\n".join(rows)


def toolchain_versions() -> dict[str, str]:
    """The NVRTC and nvdisasm the counts came from (the report's and the baseline's header)."""
    from cupy_backends.cuda.libs import nvrtc

    major, minor = nvrtc.getVersion()
    return {"nvrtc": f"{major}.{minor}", "nvdisasm": sass.nvdisasm_version()}


def write_baseline(models: Sequence[TileModel], path: Path) -> None:
    data = {
        "arch": ARCH,
        **toolchain_versions(),
        "note": "python -m dev sass --write-baseline; tests/tools/test_sass_model.py fails when "
        "instructions or LDSM per HMMA grow more than 10 % over these, or anything spills",
        "instantiations": {m.spec.label: baseline_entry(m) for m in models},
    }
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def regressions(models: Sequence[TileModel], baseline: dict, tolerance: float) -> list[str]:
    """Every hot instantiation whose instructions or LDSM per HMMA grew more than
    ``tolerance`` over ``baseline``, or that spills, in one line each."""
    problems = []
    entries = baseline["instantiations"]
    for m in models:
        label = m.spec.label
        if m.spill_bytes:
            problems.append(f"{label}: {m.spill_bytes} bytes of spills")
        if m.ptxas_warnings:
            problems.append(f"{label}: ptxas warns: {'; '.join(m.ptxas_warnings)}")
        old = entries.get(label)
        if old is None or not m.spec.hmma_per_warp_tile:
            continue
        now = baseline_entry(m)
        for key in ("instructions_per_hmma", "ldsm_per_hmma"):
            if now[key] > old[key] * (1 + tolerance):
                problems.append(
                    f"{label}: {key} {old[key]} -> {now[key]} (+{now[key] / old[key] - 1:.0%})"
                )
    return problems


# ----------------------------------------------------------------------------------------------
# CLI: python -m dev sass

DEFAULT_BASELINE = Path("bench/results/static-baseline-sm90.json")
REGRESSION_TOLERANCE = 0.10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--filter", default="", help="only instantiations whose label has this")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiler processes"
    )
    parser.add_argument("--markdown", default=None, help="also write the report to this file")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="also rebuild f532ccd's kernels from git and compare with its H100 profile",
    )
    parser.add_argument(
        "--validate",
        action="store_true",
        help="also rebuild e6a0613's and 510d8d7's kernels from git and compare with their H200"
        " counters (out of sample: nothing is fitted on them)",
    )
    parser.add_argument(
        "--write-baseline",
        metavar="FILE",
        default=None,
        help=f"write the regression baseline (e.g. {DEFAULT_BASELINE})",
    )
    parser.add_argument(
        "--check",
        metavar="BASELINE",
        default=None,
        help="fail when instructions or LDSM per HMMA grew > 10%% over BASELINE, or on spills",
    )


def run(args: argparse.Namespace) -> int:
    from cuattn.backends.toolchain import common_options, kernel_dir
    from dev import sass_roofline

    problem = missing_tools()
    if problem is not None:
        sys.stderr.write(f"python -m dev sass: {problem}\n")
        return EXIT_FAILED
    specs = [s for s in hot_specs() if args.filter in s.label]
    if not specs:
        sys.stderr.write(f"no hot instantiation matches {args.filter!r}\n")
        return EXIT_FAILED
    start = time.perf_counter()
    models = model_specs(specs, current_sources(specs), common_options(), kernel_dir(), args.jobs)
    calibration = sass_roofline.calibrate(args.jobs) if args.calibrate else None
    validation = sass_roofline.validate(args.jobs) if args.validate else None
    forward = sass_roofline.validate_sm90_forward(args.jobs) if args.validate else None
    report = sass_roofline.report(models, calibration, validation, forward)
    print(report)
    print(f"\n{len(models)} instantiations in {time.perf_counter() - start:.0f}s")
    if args.markdown:
        Path(args.markdown).write_text(report + "\n")
    if args.write_baseline:
        write_baseline(models, Path(args.write_baseline))
    if args.check:
        baseline = json.loads(Path(args.check).read_text())
        problems = regressions(models, baseline, REGRESSION_TOLERANCE)
        for line in problems:
            sys.stderr.write(f"REGRESSION {line}\n")
        if problems:
            return EXIT_FAILED
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dev sass", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
