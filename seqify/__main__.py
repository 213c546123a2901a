"""``python -m seqify``: the seqify command."""

import sys

from seqify.tools.cli import main

sys.exit(main())
