"""Parse `ptxas -v` output (as NVRTC returns it in the program log) into per-function statistics."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


@dataclass
class FunctionStats:
    """What ptxas reported for one function (entry kernel or non-inlined device function)."""

    name: str
    registers: int = 0
    static_smem_bytes: int = 0
    stack_bytes: int = 0
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0


@dataclass
class PtxasReport:
    functions: dict[str, FunctionStats] = field(default_factory=dict)

    def get(self, name: str) -> FunctionStats:
        return self.functions.setdefault(name, FunctionStats(name))


def parse_ptxas_log(log: str) -> PtxasReport:
    """Statistics per mangled function name.

    ptxas prints, per function, a "Function properties" line followed by the stack/spill line, and
    for entry functions a "Used N registers, ... bytes smem" line after "Compiling entry function".
    Lines are attributed to the most recent function header of the matching kind.
    """
    report = PtxasReport()
    entry: str | None = None
    properties_of: str | None = None
    for line in log.splitlines():
        if match := _ENTRY.search(line):
            entry = match.group(1)
            report.get(entry)
        elif match := _PROPERTIES.search(line):
            properties_of = match.group(1)
        elif (match := _FRAME.search(line)) and properties_of is not None:
            stats = report.get(properties_of)
            stats.stack_bytes = int(match.group(1))
            stats.spill_store_bytes = int(match.group(2))
            stats.spill_load_bytes = int(match.group(3))
        elif (match := _REGISTERS.search(line)) and entry is not None:
            stats = report.get(entry)
            stats.registers = int(match.group(1))
            if smem := _SMEM.search(line):
                stats.static_smem_bytes = int(smem.group(1))
    return report
