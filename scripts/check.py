#!/usr/bin/env python3
"""Run `cuattn check` from a checkout: python scripts/check.py [--quick] [--backend B]."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cuattn.tools.cli import main  # noqa: E402

sys.exit(main(["check", *sys.argv[1:]]))
