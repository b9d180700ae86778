"""``python -m data_dali.prepare``: see the package's docstring."""

import sys

from . import main

sys.exit(main())
