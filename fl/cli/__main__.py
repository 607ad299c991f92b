"""``python -m fl.cli``: the ``secagg`` command line."""

import sys

from .app import main

sys.exit(main())
