"""Command line: ``cuattn check | show | bench`` (also ``python -m cuattn ...``)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from typing import Any

import numpy as np

from cuattn import __version__
from cuattn.layout import MODES, make_layout
from cuattn.layout.layout import Layout

# Subcommands whose implementation lives in its own module, imported only when used:
# name -> (module, help). Each module provides add_arguments(parser) and run(args) -> int.
_EXTERNAL = {
    "bench": ("cuattn.tools.bench.run", "benchmark against torch SDPA and FlexAttention (GPU)"),
}


EXAMPLES = """examples:
  cuattn check                       the correctness check on the best backend present
  cuattn check --backend numpy --full
  cuattn show strided --n-ctx 256 --blocksize 16 --local-attn-ctx 8
  cuattn bench --quick               on a GPU: cuattn vs SDPA and FlexAttention
  cuattn bench --dry-run             on a CPU: the benchmark harness on the NumPy backend

the lab (static SASS model, NVRTC compile check, tiny-LM tables) runs from a checkout:
  python -m dev --help
"""


def _check(args: argparse.Namespace) -> int:
    from cuattn.tools.check import main

    return main(backend=args.backend, size=args.size)


def _show(args: argparse.Namespace) -> int:
    extra = {}
    if args.global_tokens is not None:
        extra["global_tokens"] = args.global_tokens
    layout = make_layout(
        args.mode,
        args.n_ctx,
        args.heads,
        blocksize=args.blocksize,
        local_attn_ctx=args.local_attn_ctx,
        num_verts=args.num_verts,
        vertsize=args.vertsize,
        causal=not args.bidirectional,
        **extra,
    )
    print(layout)
    print(LEGEND)
    if args.zoom:
        print(_element_picture(layout, args.zoom))
    if args.png:
        _save_png(layout, args.png)
        print(f"saved {args.png}")
    return 0


LEGEND = """legend: one character per block of blocksize x blocksize (query rows, key columns)
  █ every pair of the block attends        ░ some pairs do: the element rule picks them
  · the block is skipped (never computed)
Two patterns with the same blocks can differ inside them (strided and causal both fill the
lower triangle with ░): the element picture below tells them apart."""

ELEMENT_ON, ELEMENT_OFF = "█", "·"


def _element_picture(layout: Layout, tokens: int) -> str:
    """Which keys (columns) each of the first ``tokens`` queries (rows) attends, in head 0."""
    n_q, n_k = min(tokens, layout.n_q), min(tokens, layout.n_ctx)
    q, k = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    on = layout.allowed(np.zeros_like(q), q, k)
    rows = ["".join(ELEMENT_ON if x else ELEMENT_OFF for x in row) for row in on]
    title = (
        f"elements: the first {n_q} queries (rows) x {n_k} keys (columns) of head 0, one "
        f"character per pair ({ELEMENT_ON} attends, {ELEMENT_OFF} does not)"
    )
    return "\n".join([title, *rows])


def _save_png(layout, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--png needs matplotlib: pip install 'cuattn[plot]'") from exc
    heads = layout.heads
    fig, axes = plt.subplots(1, heads, figsize=(3 * heads, 3.2), squeeze=False)
    for h, ax in enumerate(axes[0]):
        ax.imshow(layout.blocks[h], cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(f"head {h}")
        ax.set_xlabel("key block")
        ax.set_ylabel("query block")
    fig.suptitle(
        f"{layout.name}: n_ctx={layout.n_ctx}, b={layout.blocksize}, density={layout.density:.3f}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cuattn",
        description="cuattn: block-sparse attention kernels. Correctness check, layout pictures, "
        "the NVRTC compile check and the benchmark.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"cuattn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="check every pattern/dtype/block size against float64")
    check.add_argument(
        "--backend",
        choices=("numpy", "interp", "cuda"),
        default=None,
        help="default: cuda on a GPU, else interp (needs g++), else numpy",
    )
    size = check.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        dest="size",
        action="store_const",
        const="quick",
        help="block sizes 16 and 64, head dim 64, one length (the default on the interpreter)",
    )
    size.add_argument(
        "--standard",
        dest="size",
        action="store_const",
        const="standard",
        help="block sizes 16/32/64/128, a whole and a ragged length, head dims 32/64/96/128 "
        "(the default on CUDA and NumPy)",
    )
    size.add_argument(
        "--full",
        dest="size",
        action="store_const",
        const="full",
        help="every head dim (16/32/48/64/80/96/128/256) at a whole and a ragged length of "
        "every block size",
    )
    check.set_defaults(size=None)
    check.set_defaults(func=_check)

    show = sub.add_parser(
        "show",
        help="print a pattern's block picture, with a legend and its first pairs",
        description="Draw make_layout(MODE, ...): per head, which blocks are computed, then\n"
        "which keys the first queries attend. The rules (docs/design.md §2):\n"
        "  all       causal: k <= q\n"
        "  local     causal, within the last --local-attn-ctx keys\n"
        "  strided   causal, at distances q - k that are multiples of --local-attn-ctx\n"
        "  fixed     blocks within groups of --local-attn-ctx tokens, plus summary columns\n"
        "            (--num-verts, --vertsize)",
        epilog="examples:\n  cuattn show strided --local-attn-ctx 8 --n-ctx 256 --blocksize 16"
        "\n  cuattn show fixed --local-attn-ctx 128 --num-verts 4 --vertsize 1 --png fixed.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    show.add_argument("mode", choices=MODES, help="the pattern (make_layout's attn_mode)")
    show.add_argument("--n-ctx", type=int, default=1024, help="sequence length (default 1024)")
    show.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    show.add_argument(
        "--blocksize", type=int, default=32, help="tokens per block side (default 32)"
    )
    show.add_argument(
        "--local-attn-ctx",
        type=int,
        default=None,
        metavar="N",
        help="local: window; strided: stride; fixed: group length (a multiple of blocksize)",
    )
    show.add_argument(
        "--num-verts", type=int, default=None, help="fixed: summary patterns cycled over heads"
    )
    show.add_argument(
        "--vertsize", type=int, default=None, help="fixed: summary blocks per group and head"
    )
    show.add_argument(
        "--global-tokens",
        type=int,
        nargs="*",
        default=None,
        metavar="T",
        help="longformer: token positions that attend and are attended everywhere",
    )
    show.add_argument(
        "--bidirectional",
        action="store_true",
        help="causal=False: queries see keys after them too",
    )
    show.add_argument(
        "--zoom",
        type=int,
        default=32,
        metavar="TOKENS",
        help="draw the pairs of the first TOKENS queries and keys of head 0 (default 32; 0: none)",
    )
    show.add_argument("--png", metavar="FILE", default=None, help="also save a picture")
    show.set_defaults(func=_show)

    add_module_commands(sub, _EXTERNAL)
    return parser


def add_module_commands(sub: Any, commands: dict[str, tuple[str, str]]) -> None:
    """Subcommands whose implementation is a module (name -> (module, help)) providing
    add_arguments(parser) and run(args) -> int; a module that is not there is left out."""
    for name, (module, help_text) in commands.items():
        if importlib.util.find_spec(module) is None:
            continue
        cmd = sub.add_parser(name, help=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(cmd)
        cmd.set_defaults(func=mod.run)


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse argv and run the chosen subcommand: its exit code, or 2 with one line naming the
    command where it refuses its arguments (a ValueError or TypeError)."""
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError) as exc:
        print(f"{parser.prog} {args.command}: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
