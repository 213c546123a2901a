"""``python -m seqify``: the seqify command."""

import sys

from .cli import main

sys.exit(main())
