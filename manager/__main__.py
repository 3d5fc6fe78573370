"""``python -m kvpager.manager``: the manager's command lives in ``kvpager/commands/manager.py``
(the library never imports its commands; this entry point is the one exception, allowed by name
in the import-linter contract)."""

from kvpager.commands.manager import main

if __name__ == "__main__":
    raise SystemExit(main())
