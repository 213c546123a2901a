"""Where seqify's own source lies: frames from it are seqify's, not the user's."""

import os

#: The directory of the installed ``seqify`` package.
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
