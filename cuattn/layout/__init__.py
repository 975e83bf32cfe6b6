"""Layouts: which blocks of the attention matrix are computed, and the named patterns.

A pattern is data (a block array, CSR/CSC index arrays and an element rule), never a kernel.
``make_layout`` builds a registered pattern by name (``registry``); the constructors live in
``original`` (the Sparse Transformers modes), ``extended`` (Longformer, BigBird, variable) and
``dynamic`` (chosen from the data); ``device`` holds DeviceLayout, a Layout whose arrays stay
on the device that built them. docs/design.md §2 is their contract.
"""

# isort: off
# Importing the constructor modules registers their patterns: the original's modes first, so
# that MODES keeps the original's order.
from cuattn.layout import original
from cuattn.layout import extended

# isort: on
from cuattn.layout import dynamic
from cuattn.layout.device import DeviceLayout
from cuattn.layout.layout import ElementRule, Layout
from cuattn.layout.pattern import Pattern
from cuattn.layout.registry import make_layout, modes

# Every registered pattern name (importing original and extended registered them).
MODES = modes()

__all__ = [
    "MODES",
    "DeviceLayout",
    "ElementRule",
    "Layout",
    "Pattern",
    "dynamic",
    "extended",
    "make_layout",
    "modes",
    "original",
]
