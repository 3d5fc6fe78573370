"""The commands: ``kvpager`` and its subcommands (cli, manager, worker, demo, generate, stats,
bench), and what several of them share: ``progress`` (the progress line, also the benchmarks'),
``security`` (the credential flags), ``ray_cluster`` (joining or starting a Ray node).

The top layer of the house: they parse flags, start things and print; they import the library
(``kvpager.manager``, ``kvpager.worker``, ``kvpager.scheduler``, the client) and nothing in the
library imports them (an import-linter contract in pyproject.toml checks it in ``make test``).
"""
