#!/usr/bin/env python3
"""Run `cuattn check` from a checkout: python scripts/check.py [--quick] [--backend B].

Like every script here: run from the repository root with cuattn importable (installed with
`pip install -e .`, or `PYTHONPATH=.`).
"""

import sys

from cuattn.tools.cli import main

sys.exit(main(["check", *sys.argv[1:]]))
