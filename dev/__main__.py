"""``python -m dev <command>`` from a checkout's root: the lab's commands.

compile   compile every kernel instantiation with NVRTC (errors, spills, registers)
sass      the static SASS model of the hot kernels: per-tile counts and predicted times
generate  KV-cache policies on a tiny LM: kept bytes, agreement, perplexity, long tasks
"""

from __future__ import annotations

import argparse
import sys

from cuattn.tools.cli import add_module_commands, run_command

COMMANDS = {
    "compile": ("dev.compile_check", "compile every kernel instantiation with NVRTC"),
    "sass": ("dev.sass_model", "static SASS model of the hot kernels: counts and time"),
    "generate": ("dev.generate", "KV-cache policies on a tiny LM: quality vs memory"),
}
EXAMPLES = """examples:
  python -m dev compile --arch sm_90 --jobs 4
  python -m dev sass --calibrate       per-tile SASS counts, predicted times, calibration
  python -m dev generate --png gen.png KV-cache policies: kept bytes, agreement, perplexity
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dev",
        description="cuattn's lab (a checkout only; not installed with the package)",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_module_commands(parser.add_subparsers(dest="command", required=True), COMMANDS)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
