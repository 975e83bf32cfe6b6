"""SASS of one kernel as data: disassembly with source lines, instruction classes, loops.

The static performance model (dev/sass_model.py) reads what the GPU would execute
without a GPU: NVRTC compiles a kernel with ``-lineinfo`` to a cubin, ``nvdisasm -c -gi``
(PyPI ``nvidia-cuda-nvdisasm``) prints its SASS with each instruction's source line and the
chain of inlined calls that led there, and this module turns that text into instructions
(address, predicate, opcode, operands, source chain), a class per instruction, basic blocks
and the natural loops of the converged path (a back edge to a block that dominates it; the
out-of-line divergence fallbacks ptxas places after the kernel also jump backwards, but are no
loops), and the trip count of a loop whose counter runs between constants. Nothing here knows
about attention; the attribution of loops to a kernel's hot path lives in sass_model.py.

Wavefront rules (one wavefront: 128 bytes of shared memory, 32 banks x 4 B): LDSM .x1/.x2/.x4
moves 1/2/4 8x8 16-bit matrices = 1/2/4 wavefronts; a warp's LDS/STS of W bits per lane is
W / 32 wavefronts (at least 1: conflict-free, distinct addresses); LDGSTS.128 writes 4. ``@!PT``
instructions issue (ncu counts them) but move nothing.

Instruction classes (``instruction_class``), by opcode, the classes issue #26 reports:
  HMMA    tensor-core mma.sync
  HGMMA   warpgroup MMA (wgmma, sm_90a): one per warp of the warpgroup, its operands read from
          shared memory by the tensor cores (``hgmma_shared_bytes``), not by an LDS
  LDSM    ldmatrix (shared -> registers in mma fragment layout)
  LDS/STS other shared-memory loads and stores (LDS, STS, ATOMS)
  LDGSTS  cp.async global -> shared
  BAR     CTA barriers and the copy/dependency barriers (BAR, DEPBAR, LDGDEPBAR, MEMBAR)
  MUFU    special-function unit (exp2, rcp, ...)
  FP32    float ALU, half ALU and float conversions (FFMA, FMUL, FMNMX, F2FP, HADD2, ...)
  INT     integer and predicate ALU on per-thread registers (IMAD, IADD3, LEA, LOP3, ISETP, MOV)
  uniform the uniform datapath (U*, S2UR, R2UR): one value per warp, issued like any other
  control branches, convergence barriers, exits, NOPs
  other   everything else: global/local/constant memory, shuffles, special registers
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sysconfig
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

NVDISASM = "nvdisasm"
NVDISASM_ENV = "CUATTN_NVDISASM"  # an explicit nvdisasm binary, before the wheels and PATH
# Where the nvidia-cuda-nvdisasm wheels put the binary, under site-packages.
_WHEEL_BIN_DIRS = ("nvidia/cu13/bin", "nvidia/cuda_nvdisasm/bin", "nvidia/cu12/bin")
NVDISASM_INSTALL_HINT = "pip install nvidia-cuda-nvdisasm (or 'cuattn[nvrtc]')"
NVDISASM_TIMEOUT_S = 120

# Sizes of the class table; the order is the report's column order.
CLASSES = (
    "HMMA",
    "HGMMA",
    "LDSM",
    "LDS/STS",
    "LDGSTS",
    "BAR",
    "MUFU",
    "FP32",
    "INT",
    "uniform",
    "control",
    "other",
)

_HMMA = {"HMMA"}
_HGMMA = {"HGMMA"}
_LDSM = {"LDSM"}
_SHARED = {"LDS", "STS", "ATOMS", "LDSU"}
_LDGSTS = {"LDGSTS"}
_BARRIER = {"BAR", "DEPBAR", "LDGDEPBAR", "MEMBAR", "ARRIVES", "SYNCS"}
_MUFU = {"MUFU"}
_FP32 = {
    "FADD",
    "FMUL",
    "FFMA",
    "FMNMX",
    "FSETP",
    "FSEL",
    "FSET",
    "FCHK",
    "FRND",
    "FSWZADD",
    "F2F",
    "F2FP",
    "F2I",
    "I2F",
    "I2FP",
    "HADD2",
    "HMUL2",
    "HFMA2",
    "HMNMX2",
    "HSETP2",
}
_INT = {
    "IMAD",
    "IADD3",
    "IADD",
    "IMUL",
    "IABS",
    "IMNMX",
    "VIMNMX",
    "VIADD",
    "VIADDMNMX",
    "LEA",
    "SHF",
    "SHL",
    "SHR",
    "LOP3",
    "LOP",
    "ISETP",
    "SEL",
    "PRMT",
    "MOV",
    "POPC",
    "FLO",
    "BREV",
    "BMSK",
    "SGXT",
    "PLOP3",
    "P2R",
    "R2P",
    "IDP",
    "I2I",
    "I2IP",
}
_CONTROL = {
    "BRA",
    "BRX",
    "JMP",
    "JMX",
    "EXIT",
    "RET",
    "CALL",
    "BSSY",
    "BSYNC",
    "BREAK",
    "BPT",
    "NOP",
    "YIELD",
    "WARPSYNC",
    "KILL",
    "ACQBULK",
}
_UNCONDITIONAL_END = {"EXIT", "RET", "BRA", "JMP", "BRX", "JMX"}

# Shared-memory wavefronts: one wavefront moves 128 bytes (32 banks x 4 bytes). ldmatrix moves
# 8x8 16-bit matrices, 128 B each, so .x1/.x2/.x4 are 1/2/4 wavefronts; a 32-lane LDS/STS of W
# bits, conflict-free, is 32 * W / 8 / 128 = W / 32 wavefronts (at least 1); a 16-byte cp.async
# per lane writes 512 B, 4 wavefronts. Bank conflicts add wavefronts these rules cannot see (the
# profile shows under 1 % of shared loads conflicting in our kernels).
WAVEFRONT_BYTES = 128
WARP_LANES = 32
_LDSM_MATRICES = re.compile(r"\.(?:M88|MT88)\.(\d)")
_WIDTH = re.compile(r"\.(U8|S8|U16|S16|32|64|128)\b")
_WIDTH_BITS = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "32": 32, "64": 64, "128": 128}
DEFAULT_ACCESS_BITS = 32


@dataclass(frozen=True)
class SourceLine:
    """One level of an instruction's source position: file base name and line."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction.

    ``source`` is the inline chain, innermost first: the line of the function the instruction
    came from, then the line that called (inlined) it, out to the kernel's own line; empty when
    the cubin carries no line info for it.
    """

    address: int
    opcode: str  # with modifiers, e.g. "LDSM.16.M88.4"
    operands: str
    predicate: str = ""  # e.g. "@P0", "@!PT"
    target: str | None = None  # branch/call target label
    source: tuple[SourceLine, ...] = ()

    @property
    def base(self) -> str:
        """The opcode without modifiers (``LDSM`` of ``LDSM.16.M88.4``)."""
        return self.opcode.split(".", 1)[0]

    @property
    def never_executes(self) -> bool:
        """``@!PT``: a placeholder the scheduler never issues."""
        return self.predicate == "@!PT"

    @property
    def klass(self) -> str:
        return instruction_class(self.opcode)

    def in_lines(self, file: str, first: int, last: int) -> bool:
        """Whether any level of the inline chain lies in ``file`` lines first..last."""
        return any(s.file == file and first <= s.line <= last for s in self.source)


@dataclass(frozen=True)
class Block:
    """A basic block: instructions ``first``..``last`` (indices into the kernel's list)."""

    index: int
    first: int
    last: int
    successors: tuple[int, ...]  # blocks control can reach next on the converged path


@dataclass(frozen=True)
class Loop:
    """A natural loop: a back edge to a header block that dominates its source, and every
    block that reaches the back edge without passing the header. Back edges to one header are
    one loop. ``children`` are the loops nested in it, ``depth`` 0 for outermost loops."""

    header: int  # block index
    blocks: frozenset[int]
    latches: tuple[int, ...]  # sources of the back edges
    depth: int = 0
    children: tuple[Loop, ...] = ()


@dataclass
class Kernel:
    """The SASS of one kernel function (its .text section, subroutines included).

    The control-flow graph follows the converged path only: a ``BRA.DIV`` (taken when the
    warp has diverged, to out-of-line shuffle/vote fallbacks) and a ``CALL`` (to a slow-path
    subroutine such as the IEEE reciprocal's) do not lead anywhere the hot path goes, so the
    code they reach is unreachable here and counted nowhere, as are the ``BRA`` padding loops
    after the last ``EXIT``.
    """

    name: str
    instructions: list[Instruction]
    labels: dict[str, int] = field(default_factory=dict)  # label -> address

    @functools.cached_property
    def index_of(self) -> dict[int, int]:
        return {inst.address: n for n, inst in enumerate(self.instructions)}

    @functools.cached_property
    def blocks(self) -> list[Block]:
        return build_blocks(self.instructions, self.labels, self.index_of)

    @functools.cached_property
    def block_of(self) -> list[int]:
        """Block index of every instruction."""
        owner = [0] * len(self.instructions)
        for block in self.blocks:
            for n in range(block.first, block.last + 1):
                owner[n] = block.index
        return owner

    @functools.cached_property
    def reachable(self) -> frozenset[int]:
        """Blocks reachable from the entry on the converged path."""
        return frozenset(_reach(self.blocks, 0, avoid=None))

    @functools.cached_property
    def loops(self) -> list[Loop]:
        """Outermost natural loops, in address order, each with its nested loops."""
        return find_loops(self.blocks, self.reachable)

    def block_instructions(self, blocks: Iterable[int]) -> list[Instruction]:
        out: list[Instruction] = []
        for b in sorted(blocks):
            block = self.blocks[b]
            out.extend(self.instructions[block.first : block.last + 1])
        return out


def instruction_class(opcode: str) -> str:
    """The report class of an opcode (see the module docstring)."""
    base = opcode.split(".", 1)[0]
    if base in _HMMA:
        return "HMMA"
    if base in _HGMMA:
        return "HGMMA"
    if base in _LDSM:
        return "LDSM"
    if base in _SHARED:
        return "LDS/STS"
    if base in _LDGSTS:
        return "LDGSTS"
    if base in _BARRIER:
        return "BAR"
    if base in _MUFU:
        return "MUFU"
    if base in _FP32:
        return "FP32"
    if base in _INT:
        return "INT"
    if base in _CONTROL:
        return "control"
    if base.startswith("U") or base in ("S2UR", "R2UR"):
        return "uniform"
    return "other"


# HGMMA.<M>x<N>x<K>.<accumulator>.<input type>: the warpgroup's shape; a warp computes M / 4
# of its rows. A source operand ``gdesc[...]`` is a shared-memory descriptor, a register is A
# held in registers (B is always in shared memory).
_HGMMA_SHAPE = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)\.")
_HGMMA_INPUT_BYTES = {"F16": 2, "BF16": 2, "E4M3": 1, "E5M2": 1, "TF32": 4}
WARPGROUP_WARPS = 4


def hgmma_shape(opcode: str) -> tuple[int, int, int] | None:
    """(M, N, K) of a warpgroup MMA opcode (``HGMMA.64x128x16.F32.BF16``), None otherwise."""
    match = _HGMMA_SHAPE.match(opcode)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3]))


def hgmma_flop(opcode: str) -> int:
    """FLOP one warp's share of an HGMMA does (its M / 4 rows), 0 for any other opcode."""
    shape = hgmma_shape(opcode)
    if shape is None:
        return 0
    m, n, k = shape
    return 2 * m // WARPGROUP_WARPS * n * k


def hgmma_shared_bytes(inst: Instruction) -> int:
    """Shared-memory bytes one warp's share of an HGMMA reads: a quarter of B (N x K), plus a
    quarter of A (M x K) where A comes from a descriptor, not registers. Stated assumption: the
    warpgroup reads each operand byte once (B is not read again for each warp's rows)."""
    shape = hgmma_shape(inst.opcode)
    if shape is None:
        return 0
    m, n, k = shape
    item = next((b for t, b in _HGMMA_INPUT_BYTES.items() if f".{t}" in inst.opcode), 2)
    a_in_shared = _operands(inst)[1].startswith("gdesc")
    return ((n * k) + (m * k if a_in_shared else 0)) * item // WARPGROUP_WARPS


def shared_load_wavefronts(opcode: str) -> int:
    """Shared-memory load wavefronts of one warp-wide LDSM / LDS (0 for anything else)."""
    base = opcode.split(".", 1)[0]
    if base == "LDSM":
        match = _LDSM_MATRICES.search(opcode)
        return int(match.group(1)) if match else 1
    if base in ("LDS", "LDSU"):
        return _access_wavefronts(opcode)
    return 0


def shared_store_wavefronts(opcode: str) -> int:
    """Shared-memory write wavefronts of one warp-wide STS / LDGSTS (0 for anything else)."""
    base = opcode.split(".", 1)[0]
    if base in ("STS", "LDGSTS"):
        return _access_wavefronts(opcode)
    return 0


def _access_wavefronts(opcode: str) -> int:
    match = _WIDTH.search(opcode)
    bits = _WIDTH_BITS[match.group(1)] if match else DEFAULT_ACCESS_BITS
    return max(1, WARP_LANES * bits // 8 // WAVEFRONT_BYTES)


_INSTRUCTION = re.compile(
    r"^\s*/\*(?P<address>[0-9a-f]+)\*/\s+(?P<predicate>@!?U?P[T0-9]+\s+)?(?P<body>[^;]*?)\s*;"
)
_LABEL = re.compile(r"^(?P<label>[.$\w]+):\s*$")
_SECTION = re.compile(r"^//-+ \.text\.(?P<name>\S+)\s+-+\s*$")
_SOURCE = re.compile(
    r'^\s*//## File "(?P<file>[^"]+)", line (?P<line>\d+)'
    r'(?: inlined at "(?P<outer_file>[^"]+)", line (?P<outer_line>\d+))?'
)
_TARGET = re.compile(r"`\((?P<target>[^)]+)\)")


def parse(text: str) -> dict[str, Kernel]:
    """Every function section of ``nvdisasm -c [-g|-gi]`` output, by mangled name.

    With ``-gi`` each instruction is preceded by one ``//## File`` line per inlining level
    (innermost first, each naming its caller with "inlined at"); the chain is kept on every
    instruction until the next ``//##`` block. Files are reduced to their base names.
    """
    kernels: dict[str, Kernel] = {}
    current: Kernel | None = None
    chain: list[SourceLine] = []
    reading_chain = False
    for raw in text.splitlines():
        if match := _SECTION.match(raw):
            current = Kernel(match.group("name"), [])
            kernels[current.name] = current
            chain, reading_chain = [], False
            continue
        if current is None:
            continue
        if match := _SOURCE.match(raw):
            if not reading_chain:
                chain, reading_chain = [], True
            level = SourceLine(os.path.basename(match.group("file")), int(match.group("line")))
            if not chain or chain[-1] != level:
                chain.append(level)
            if match.group("outer_file"):
                chain.append(
                    SourceLine(
                        os.path.basename(match.group("outer_file")),
                        int(match.group("outer_line")),
                    )
                )
            continue
        reading_chain = False
        if match := _LABEL.match(raw.strip()):
            current.labels[match.group("label")] = _next_address(current)
            continue
        if match := _INSTRUCTION.match(raw):
            body = match.group("body").strip()
            opcode, _, operands = body.partition(" ")
            target = _TARGET.search(operands)
            current.instructions.append(
                Instruction(
                    address=int(match.group("address"), 16),
                    opcode=opcode,
                    operands=operands.strip(),
                    predicate=(match.group("predicate") or "").strip(),
                    target=target.group("target") if target else None,
                    source=_dedupe(chain),
                )
            )
    for kernel in kernels.values():
        _resolve_label_addresses(kernel)
    return kernels


def _next_address(kernel: Kernel) -> int:
    """A label precedes the next instruction; its address is fixed once that one is read."""
    return -1 - len(kernel.instructions)  # placeholder: -(index of the next instruction) - 1


def _resolve_label_addresses(kernel: Kernel) -> None:
    for label, placeholder in list(kernel.labels.items()):
        if placeholder < 0:
            index = -1 - placeholder
            if index < len(kernel.instructions):
                kernel.labels[label] = kernel.instructions[index].address
            else:
                del kernel.labels[label]  # a label after the last instruction


def _dedupe(chain: Sequence[SourceLine]) -> tuple[SourceLine, ...]:
    out: list[SourceLine] = []
    for level in chain:
        if not out or out[-1] != level:
            out.append(level)
    return tuple(out)


def _is_conditional(inst: Instruction) -> bool:
    """A branch that may fall through: predicated, or with a predicate operand before its
    target (``BRA !UP0, `(...)``), or taken only when the warp diverged (``BRA.DIV``)."""
    if inst.predicate and inst.predicate != "@PT":
        return True
    if ".DIV" in inst.opcode:
        return True
    return bool(inst.operands.split("`", 1)[0].strip(" ,"))


def build_blocks(
    instructions: Sequence[Instruction], labels: dict[str, int], index_of: dict[int, int]
) -> list[Block]:
    """Basic blocks and their converged-path successors (see ``Kernel``). An indirect jump
    (BRX/JMX, a switch table) ends its block with no known successor; none of the kernels has
    one."""
    if not instructions:
        return []
    leaders = {0}
    for address in labels.values():
        if address in index_of:
            leaders.add(index_of[address])
    for n, inst in enumerate(instructions):
        if inst.target is not None or inst.base in _UNCONDITIONAL_END:
            leaders.add(n + 1)
    starts = sorted(s for s in leaders if s < len(instructions))
    block_at = {start: b for b, start in enumerate(starts)}
    blocks = []
    for b, first in enumerate(starts):
        last = (starts[b + 1] if b + 1 < len(starts) else len(instructions)) - 1
        inst = instructions[last]
        successors: list[int] = []
        falls_through = True
        if inst.never_executes:
            pass  # an @!PT instruction does nothing
        elif inst.base in ("BRA", "JMP") and inst.target is not None:
            target = labels.get(inst.target)
            if ".DIV" not in inst.opcode and target in index_of:
                successors.append(block_at[index_of[target]])
            falls_through = _is_conditional(inst)
        elif inst.base in _UNCONDITIONAL_END:
            falls_through = bool(inst.predicate) and inst.predicate != "@PT"
        if falls_through and last + 1 < len(instructions):
            successors.append(block_at[last + 1])
        blocks.append(Block(b, first, last, tuple(dict.fromkeys(successors))))
    return blocks


def _reach(blocks: Sequence[Block], start: int, avoid: int | None) -> set[int]:
    seen = {start}
    stack = [start]
    while stack:
        for succ in blocks[stack.pop()].successors:
            if succ != avoid and succ not in seen:
                seen.add(succ)
                stack.append(succ)
    return seen


def _dominators(blocks: Sequence[Block], reachable: frozenset[int]) -> dict[int, int]:
    """Dominator sets as bit masks (bit b: block b dominates), iterated to the fixed point."""
    predecessors: dict[int, list[int]] = {b: [] for b in reachable}
    for b in reachable:
        for succ in blocks[b].successors:
            predecessors[succ].append(b)
    everything = 0
    for b in reachable:
        everything |= 1 << b
    dom = {b: everything for b in reachable}
    dom[0] = 1
    order = sorted(reachable)
    changed = True
    while changed:
        changed = False
        for b in order:
            if b == 0:
                continue
            meet = everything
            for p in predecessors[b]:
                meet &= dom[p]
            value = meet | (1 << b)
            if value != dom[b]:
                dom[b] = value
                changed = True
    return dom


def find_loops(blocks: Sequence[Block], reachable: frozenset[int]) -> list[Loop]:
    """Natural loops of the reachable graph, nested: a back edge is an edge to a block that
    dominates its source; its loop is the header plus every block that reaches the source
    without passing through the header."""
    if not blocks:
        return []
    dom = _dominators(blocks, reachable)
    predecessors: dict[int, list[int]] = {b: [] for b in reachable}
    for b in reachable:
        for succ in blocks[b].successors:
            predecessors[succ].append(b)
    bodies: dict[int, set[int]] = {}
    latches: dict[int, list[int]] = {}
    for source in sorted(reachable):
        for header in blocks[source].successors:
            if dom[source] >> header & 1:
                body = bodies.setdefault(header, {header})
                latches.setdefault(header, []).append(source)
                stack = [source]
                while stack:
                    b = stack.pop()
                    if b not in body:
                        body.add(b)
                        stack.extend(predecessors[b])
    loops = [Loop(h, frozenset(body), tuple(latches[h])) for h, body in bodies.items()]
    return _nest(loops, depth=0)


def _nest(loops: list[Loop], depth: int) -> list[Loop]:
    """Arrange loops by body inclusion (largest first); a loop's children are the maximal loops
    inside it."""
    ordered = sorted(loops, key=lambda loop: (-len(loop.blocks), loop.header))
    roots: list[Loop] = []
    placed: list[tuple[Loop, list[Loop]]] = []
    for loop in ordered:
        parent = next((p for p in reversed(placed) if loop.blocks <= p[0].blocks), None)
        kids: list[Loop] = []
        placed.append((loop, kids))
        if parent is None:
            roots.append(loop)
        else:
            parent[1].append(loop)
    children = {id(loop): kids for loop, kids in placed}

    def build(loop: Loop, level: int) -> Loop:
        nested = sorted(children[id(loop)], key=lambda c: c.header)
        return Loop(
            loop.header,
            loop.blocks,
            loop.latches,
            level,
            tuple(build(c, level + 1) for c in nested),
        )

    return [build(loop, depth) for loop in sorted(roots, key=lambda r: r.header)]


def walk_loops(loops: Iterable[Loop]) -> Iterable[Loop]:
    """Every loop of a forest, parents before their children."""
    for loop in loops:
        yield loop
        yield from walk_loops(loop.children)


_REGISTER = re.compile(r"^(U?R\d+|U?RZ)$")
_IMMEDIATE = re.compile(r"^-?(0x[0-9a-f]+|\d+)$")
MAX_COUNTED_TRIPS = 1 << 16


def _operands(inst: Instruction) -> list[str]:
    return [o.strip() for o in inst.operands.split(",")]


def _immediate(token: str) -> int | None:
    token = token.strip()
    if token in ("RZ", "URZ"):
        return 0
    if _IMMEDIATE.match(token):
        return int(token, 0)
    return None


def counted_trips(kernel: Kernel, loop: Loop) -> int | None:
    """Iterations of a loop whose counter starts, steps and ends at constants, or None.

    The shape ptxas gives a ``for (i = A; i < B; i += C)`` it keeps rolled: the latch branch
    ``@[!]P BRA header`` tests ``ISETP.<cmp>[.U32].AND P, PT, R, B, PT``; the loop adds C to R
    once (``VIADD R, R, C`` / ``IADD3 R, R, C, RZ``); the last write of R before the header
    sets A (``MOV``/``IMAD.MOV.U32 R, RZ, RZ, A``, or RZ). Anything else (a counter from
    threadIdx, a bound from memory) is not counted here.
    """
    latch_block = kernel.blocks[max(loop.latches)]
    branch = kernel.instructions[latch_block.last]
    if branch.base != "BRA" or not branch.predicate:
        return None
    negated = branch.predicate.startswith("@!")
    predicate = branch.predicate.lstrip("@!")
    body = kernel.block_instructions(loop.blocks)
    test = next(
        (
            i
            for i in reversed(body)
            if i.address < branch.address
            and i.base in ("ISETP", "UISETP")
            and _operands(i)[0] == predicate
        ),
        None,
    )
    if test is None:
        return None
    fields = test.opcode.split(".")
    compare = fields[1] if len(fields) > 1 else ""
    unsigned = "U32" in fields
    ops = _operands(test)
    if len(ops) < 4 or ops[1] not in ("PT", "UPT"):
        return None
    counter, bound = ops[2], _immediate(ops[3])
    if bound is None or not _REGISTER.match(counter) or counter in ("RZ", "URZ"):
        return None
    steps = [i for i in body if _writes(i, counter)]
    if len(steps) != 1:
        return None
    step = _increment(steps[0], counter)
    if step is None or step == 0:
        return None
    header_address = kernel.instructions[kernel.blocks[loop.header].first].address
    start = _initial_value(kernel, header_address, counter)
    if start is None:
        return None
    tested_after_step = test.address > steps[0].address
    value = start
    for trips in range(1, MAX_COUNTED_TRIPS):
        before = value
        value += step
        checked = value if tested_after_step else before
        taken = _compare(compare, checked, bound, unsigned)
        if taken == negated:  # the branch back is not taken: the loop ends
            return trips
    return None


def _writes(inst: Instruction, register: str) -> bool:
    ops = _operands(inst)
    return bool(ops) and ops[0] == register and inst.klass not in ("control", "BAR")


def _increment(inst: Instruction, register: str) -> int | None:
    ops = _operands(inst)
    if inst.base in ("VIADD", "UIADD3", "IADD3") and len(ops) >= 3 and ops[1] == register:
        extra = [_immediate(o) for o in ops[2:]]
        if all(e is not None for e in extra):
            return sum(e for e in extra if e is not None)
    return None


def _initial_value(kernel: Kernel, header_address: int, register: str) -> int | None:
    for inst in reversed(kernel.instructions[: kernel.index_of[header_address]]):
        if not _writes(inst, register):
            continue
        ops = _operands(inst)
        if inst.base in ("MOV", "UMOV") and len(ops) == 2:
            return _immediate(ops[1])
        if inst.opcode.startswith("IMAD.MOV") and len(ops) == 4 and ops[1] == ops[2] == "RZ":
            return _immediate(ops[3])
        if inst.base == "CS2R" and ops[1:] == ["SRZ"]:
            return 0
        return None
    return None


def _compare(kind: str, a: int, b: int, unsigned: bool) -> bool:
    if unsigned:
        a, b = a % (1 << 32), b % (1 << 32)
    return {
        "LT": a < b,
        "LE": a <= b,
        "GT": a > b,
        "GE": a >= b,
        "EQ": a == b,
        "NE": a != b,
    }.get(kind, False)


def class_counts(instructions: Iterable[Instruction]) -> Counter:
    """Instructions per class (``@!PT`` placeholders excluded: they never issue)."""
    return Counter(i.klass for i in instructions if not i.never_executes)


# ----------------------------------------------------------------------------------------------
# nvdisasm


def find_nvdisasm() -> str | None:
    """Path of an nvdisasm binary: $CUATTN_NVDISASM, the nvidia-cuda-nvdisasm wheel of this
    environment, then PATH and CUDA_HOME/CUDA_PATH/usr/local/cuda; None when there is none."""
    explicit = os.environ.get(NVDISASM_ENV)
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    site = Path(sysconfig.get_paths()["purelib"])
    for sub in _WHEEL_BIN_DIRS:
        candidate = site / sub / NVDISASM
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(NVDISASM)
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(Path(root) / "bin" / NVDISASM, os.X_OK):
            return str(Path(root) / "bin" / NVDISASM)
    return None


def nvdisasm_version(nvdisasm: str | None = None) -> str:
    """The release line of ``nvdisasm --version`` (e.g. "Cuda compilation tools, release 13.1,
    V13.1.80"), empty when there is no nvdisasm."""
    tool = nvdisasm or find_nvdisasm()
    if tool is None:
        return ""
    result = subprocess.run(
        [tool, "--version"], capture_output=True, text=True, timeout=NVDISASM_TIMEOUT_S
    )
    lines = [line for line in result.stdout.splitlines() if "release" in line]
    return lines[-1].strip() if lines else result.stdout.strip()


def disassemble(cubin: bytes, workdir: Path, nvdisasm: str | None = None) -> str:
    """``nvdisasm -c -gi`` of a cubin (code sections, source lines with inlining chains)."""
    tool = nvdisasm or find_nvdisasm()
    if tool is None:
        raise FileNotFoundError(f"nvdisasm not found; {NVDISASM_INSTALL_HINT}")
    path = workdir / "kernel.cubin"
    path.write_bytes(complete_elf(cubin))
    result = subprocess.run(
        [tool, "-c", "-gi", str(path)],
        capture_output=True,
        text=True,
        timeout=NVDISASM_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {result.stderr.strip()}")
    return result.stdout


_ELF64_PHOFF = 0x20
_ELF64_SHOFF = 0x28
_ELF64_PHENTSIZE = 0x36
_ELF64_SHENTSIZE = 0x3A


def complete_elf(image: bytes) -> bytes:
    """The cubin padded with zero bytes to the length its ELF header implies.

    CuPy's ``nvrtc.getCUBIN`` drops the image's last byte (it treats the cubin like the
    NUL-terminated PTX), and nvdisasm rejects a file that ends inside its program-header table;
    the missing byte is the top byte of the last header's alignment field, always zero.
    """
    if len(image) < 0x40 or image[:4] != b"\x7fELF":
        return image
    phoff = int.from_bytes(image[_ELF64_PHOFF : _ELF64_PHOFF + 8], "little")
    shoff = int.from_bytes(image[_ELF64_SHOFF : _ELF64_SHOFF + 8], "little")
    phentsize = int.from_bytes(image[_ELF64_PHENTSIZE : _ELF64_PHENTSIZE + 2], "little")
    phnum = int.from_bytes(image[_ELF64_PHENTSIZE + 2 : _ELF64_PHENTSIZE + 4], "little")
    shentsize = int.from_bytes(image[_ELF64_SHENTSIZE : _ELF64_SHENTSIZE + 2], "little")
    shnum = int.from_bytes(image[_ELF64_SHENTSIZE + 2 : _ELF64_SHENTSIZE + 4], "little")
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return image + b"\x00" * (end - len(image)) if end > len(image) else image
