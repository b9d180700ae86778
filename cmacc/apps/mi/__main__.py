"""``python -m cmacc.apps.mi``: see the package's docstring."""

import sys

from .cli import main

sys.exit(main())
