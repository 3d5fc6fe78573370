"""``python -m kvpager``: the ``kvpager`` command (see ``kvpager.cli``)."""

import sys

from kvpager.cli import main

sys.exit(main())
