"""The commands: ``kvpager`` and its subcommands (cli, manager, worker, demo, generate, stats).

The top layer of the house: they parse flags, start things and print; they import the library
(``kvpager.manager``, ``kvpager.worker``, ``kvpager.scheduler``, the client) and nothing in the
library imports them (an import-linter contract in pyproject.toml checks it in ``make test``).
"""
