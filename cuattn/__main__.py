import sys

from cuattn.tools.cli import main

sys.exit(main())
