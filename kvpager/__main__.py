"""``python -m kvpager``: the ``kvpager`` command (see ``kvpager.commands.cli``)."""

import sys

from kvpager.commands.cli import main

sys.exit(main())
