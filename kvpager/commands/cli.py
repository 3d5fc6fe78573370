"""``kvpager``: one command with a subcommand per job (``manager``, ``worker``, ``generate``, ``demo``,
``stats``, ``bench``).

This module holds the conventions every subcommand shares and wires them together; each
subcommand lives in its own module, which provides ``configure(parser)`` (its flags) and
``run(args) -> int``. Only the chosen subcommand's module is imported, so ``kvpager stats``
never pays for torch or Ray.

Conventions:

- every flag also reads an environment variable, ``KVPAGER_<NAME>``, named with its default in
  the flag's help (flags win; ``source`` says where a value came from, so that of two flags that
  clash the typed one wins over the environment's, whose value is ignored as silently as a
  variable whose own flag was typed: ``settle``); an environment value is checked like a typed
  flag, and only by the subcommand that reads it;
- a bad flag prints one line, ``kvpager <sub>: error: <what> (see kvpager <sub> --help)``, and
  exits 2; a failure at run time (an address that does not answer, a port in use, a bad
  configuration) prints one line, ``kvpager <sub>: <what>``, and exits 1; Ctrl-C exits 130
  quietly. No traceback reaches the user unless ``KVPAGER_DEBUG=1``.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import inspect
import logging
import math
import os
import re
import sys

# gRPC core's INFO lines (fork handlers skipped while Ray starts its processes, GOAWAY at
# shutdown) are noise on a terminal; set before anything imports grpc. Any explicit value wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
import traceback
import warnings
from typing import Any, Callable, Optional, Sequence

from kvpager import package_version

# torch warns at import when numpy is missing, which it does not need here: keep errors one line.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

DEBUG_ENV = "KVPAGER_DEBUG"
EPILOG = "Every flag also reads the environment variable named in its help; a flag on the command line wins."
DESCRIPTION = "kvpager: a paged KV-cache block manager served over gRPC, its cache workers on Ray, and tools."
TOP_EPILOG = f"""examples (one machine, on loopback: --insecure; docs/security.md for credentials):
  kvpager manager --insecure --port 50051 --metrics-port 9400
  kvpager worker --insecure --manager 127.0.0.1:50051 --tensor-parallel-size 2
  kvpager stats --manager 127.0.0.1:50051
  kvpager generate --model DIR "The capital of France is"
  kvpager demo
  kvpager bench --list

`kvpager COMMAND --help` describes a command and its flags. {EPILOG}"""


class UsageError(Exception):
    """Flags that parse but do not make sense together: reported like a bad flag (exit 2)."""


class Failure(Exception):
    """A failure the user can act on (unreachable address, port in use...): one line, exit 1."""


class _FromEnv:
    """A flag's default taken from the environment, converted and checked only after parsing, so a
    bad value names its variable and only the subcommand that reads it complains."""

    def __init__(self, raw: str) -> None:
        self.raw = raw


class _Default:
    """A flag's own default, wrapped until parsing ends: argparse replaces either wrapper only
    when the flag is on the command line, so what is still wrapped says where a value came from."""

    def __init__(self, value: Any) -> None:
        self.value = value


class Source(enum.IntEnum):
    """Where a flag's value came from; a larger one wins over a smaller one (flags over the
    environment over defaults), also between two flags that say one thing two ways."""

    DEFAULT = 0
    ENVIRONMENT = 1
    COMMAND_LINE = 2


# The namespace attributes holding {dest: Source} and {dest: its default} for every ``flag``
# (argparse copies them from a subcommand's namespace to the top one with the values).
_SOURCES = "_flag_sources"
_DEFAULTS = "_flag_defaults"


def source(args: argparse.Namespace, dest: str) -> Source:
    """Where ``args.<dest>`` came from (a namespace not made by a ``Parser``: the command line)."""
    sources: dict[str, Source] = getattr(args, _SOURCES, {})
    return sources.get(dest, Source.COMMAND_LINE)


def outranks(args: argparse.Namespace, dest: str, other: str) -> bool:
    """Whether flag ``dest``'s value came from a stronger source than flag ``other``'s: of two
    flags that say one thing two ways (``--once``, ``--count``), the one typed wins over one from
    the environment, whatever the order the code reads them in."""
    return source(args, dest) > source(args, other)


def settle(args: argparse.Namespace, one: str | Sequence[str], other: str | Sequence[str]) -> bool:
    """Settle a clash between two sides set in ways that exclude each other (each a flag's dest, or
    the dests of flags that together say one thing, such as a deployment's two addresses): the
    side typed on the command line wins over one from the environment, whose flags are set back
    to their defaults (as if unset, silently, as a variable whose own flag was typed is ignored).
    False, changing nothing, when neither side outranks the other (both typed, or both from the
    environment): the caller refuses, naming the flags. A side at its defaults never clashes."""
    sides = [(one,) if isinstance(one, str) else tuple(one), (other,) if isinstance(other, str) else tuple(other)]
    strongest = [max(source(args, dest) for dest in side) for side in sides]
    if strongest[0] == strongest[1]:
        return False
    loser = sides[0] if strongest[0] < strongest[1] else sides[1]
    sources: dict[str, Source] = dict(getattr(args, _SOURCES))
    for dest in loser:
        setattr(args, dest, getattr(args, _DEFAULTS)[dest])
        sources[dest] = Source.DEFAULT
    setattr(args, _SOURCES, sources)
    return True


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and whose defaults may come from KVPAGER_*."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("epilog", EPILOG)
        if kwargs.get("description"):  # a module's docstring
            kwargs["description"] = inspect.cleandoc(kwargs["description"]).replace("``", "`")
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        namespace, extras = super().parse_known_args(args, namespace)
        sources = dict(getattr(namespace, _SOURCES, {}))  # a subcommand's, when this is the top parser
        defaults = dict(getattr(namespace, _DEFAULTS, {}))
        for action in self._actions:
            env = getattr(action, "env", None)
            if env is None:
                continue
            value = getattr(namespace, action.dest, None)
            if isinstance(value, _FromEnv):
                value, sources[action.dest] = self._convert_env(action, env, value.raw), Source.ENVIRONMENT
            elif isinstance(value, _Default):
                value, sources[action.dest] = value.value, Source.DEFAULT
            else:
                sources[action.dest] = Source.COMMAND_LINE
            setattr(namespace, action.dest, value)
            defaults[action.dest] = action.unset  # type: ignore[attr-defined]
            if value is None and getattr(action, "env_required", False):
                self.error(f"{action.option_strings[0]} (or {env}) is required")
        setattr(namespace, _SOURCES, sources)
        setattr(namespace, _DEFAULTS, defaults)
        return namespace, extras

    def _convert_env(self, action: argparse.Action, env: str, raw: str) -> Any:
        convert = getattr(action, "env_type", None) or action.type or str
        try:
            value = convert(raw)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as err:
            self.error(f"{env}={raw!r} (for {action.option_strings[0]}): {err}")
        if action.choices is not None and value not in action.choices:
            self.error(f"{env}={raw!r} (for {action.option_strings[0]}): choose from "
                       f"{', '.join(map(str, action.choices))}")
        return value


def kv_cache_flags(parser: argparse.ArgumentParser, note: str = "") -> None:
    """``--kv-cache-dtype`` and ``--kv-scale``: how the workers store K/V (``kvpager worker``, the demo)."""
    flag(parser, "--kv-cache-dtype", env="KVPAGER_KV_CACHE_DTYPE", choices=("auto", "fp8_e4m3"), default="auto",
         help=f"KV storage: the model's dtype, or fp8 e4m3 scaled by --kv-scale{note}")
    flag(parser, "--kv-scale", env="KVPAGER_KV_SCALE", type=positive_float, default=0.25, metavar="X",
         help=f"per-tensor K/V scale of an fp8 cache{note}")


def fields_as_flags(message: str, names: Sequence[str]) -> str:
    """A configuration's message in the words of the flags that set its fields ("block_size must
    be in [1, 1024]" -> "--block-size must be in [1, 1024]"): the user typed flags."""
    if not names:
        return message
    return re.sub(r"\b(" + "|".join(map(re.escape, names)) + r")\b", lambda m: "--" + m[1].replace("_", "-"), message)


# Model settings that the model flags set, as the model's checks (worker/hf_config.py) name them.
_MODEL_FIELDS = ("max_model_len", "tensor_parallel_size", "kv_cache_dtype", "kv_scale")
_SERVES = " (kvpager serves model types"  # UnsupportedModel's tail: the models kvpager serves


def model_error_as_flags(message: str) -> str:
    """A model check's message in the words of the flags ("tensor_parallel_size 3 does not divide
    ..." -> "--tensor-parallel-size 3 does not divide ..."); where a flag is to blame, without
    UnsupportedModel's list of the models kvpager serves, which is about the checkpoint."""
    renamed = fields_as_flags(message, _MODEL_FIELDS)
    if renamed == message:
        return message
    return renamed.removeprefix("unsupported model: ").split(_SERVES)[0]


DTYPES = ("auto", "float32", "bfloat16", "float16")


def dtype_flag(parser: argparse.ArgumentParser, auto_help: str = "bfloat16 on CUDA, float32 on the CPU") -> None:
    """``--dtype``: the model's weights and activations (``kvpager worker``, ``generate``, the demo)."""
    flag(parser, "--dtype", env="KVPAGER_DTYPE", choices=DTYPES, default="auto",
         help=f"weights and activations of a checkpoint: auto is {auto_help}")


def device_flag(parser: argparse.ArgumentParser, auto_help: str) -> None:
    """``--device``: where the workers run (``kvpager worker``, ``generate``, the demo)."""
    flag(parser, "--device", env="KVPAGER_WORKER_DEVICE", choices=("auto", "cuda", "cpu"), default="auto",
         help=f"where the workers run: auto is {auto_help}")


def flag_table(parser: argparse.ArgumentParser, rows: Sequence[tuple]) -> None:
    """``flag`` for each row of a table of flags of one kind: (name, env, type, default,
    metavar, help)."""
    for name, env, kind, default, metavar, text in rows:
        flag(parser, name, env=env, type=kind, default=default, metavar=metavar, help=text)


def resolve_dtype(choice: str, cuda: bool) -> str:
    """--dtype auto: bfloat16 where the model runs on CUDA, float32 on the CPU."""
    return choice if choice != "auto" else ("bfloat16" if cuda else "float32")


def flag(parser: argparse.ArgumentParser, name: str, *, env: str, help: str, type: Callable[[str], Any] = str,
         default: Any = None, default_help: Optional[str] = None, required: bool = False,
         choices: Optional[Sequence[Any]] = None, metavar: Optional[str] = None) -> argparse.Action:
    """Add ``--name`` (``type=bool`` makes a switch) whose default the environment variable ``env``
    overrides. Its help ends with ``[env ENV; default D]`` (and the value the environment sets now)."""
    raw = os.environ.get(env) or None  # set but empty (compose passes such) counts as unset
    shown = default_help if default_help is not None else ("unset" if default is None else str(default))
    now = f"={raw}" if raw is not None else ""
    text = f"{help} [env {env}{now}; {'required' if required else 'default ' + shown}]".replace("%", "%%")
    # Both kinds of default stay wrapped until parsing ends (Parser.parse_known_args), which keeps
    # where each value came from (``source``).
    unset = bool(default) if type is bool else default
    start = _FromEnv(raw) if raw is not None else _Default(unset)
    if metavar is None and type is address:
        metavar = "HOST:PORT"
    if type is bool:
        action = parser.add_argument(name, action="store_true", default=start, help=text)
        action.env_type = parse_bool  # type: ignore[attr-defined]
    else:
        action = parser.add_argument(name, type=type, default=start, choices=choices, metavar=metavar, help=text)
    action.env = env  # type: ignore[attr-defined]
    action.env_required = required  # type: ignore[attr-defined]
    action.unset = unset  # type: ignore[attr-defined]  # its value when unset (``settle``)
    return action


# ---- value types ----------------------------------------------------------------------------------
def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {text!r}")


def address(text: str) -> str:
    """HOST:PORT with a port in 1..65535 (``[v6]:port`` works too)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return text


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _bounded(name: str, parse: Callable[[str], Any], accepts: Callable[[Any], bool],
             requirement: str) -> Callable[[str], Any]:
    """A flag type: ``parse`` the text, then refuse a value ``accepts`` rejects, saying
    ``requirement`` ("must be >= 1, got 0")."""
    def convert(text: str) -> Any:
        value = parse(text)
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"{requirement}, got {value}")
        return value
    convert.__name__ = name
    return convert


non_negative_int = _bounded("non_negative_int", integer, lambda v: v >= 0, "must be >= 0")
positive_int = _bounded("positive_int", integer, lambda v: v >= 1, "must be >= 1")
port_number = _bounded("port_number", integer, lambda v: 0 <= v < 65536, "must be a port in 0..65535 (0: a free one)")
positive_float = _bounded("positive_float", number, lambda v: 0 < v < math.inf, "must be > 0 and finite")
fraction = _bounded("fraction", number, lambda v: 0 < v <= 1, "must be in (0, 1]")   # a share of memory, a probability mass
non_negative_float = _bounded("non_negative_float", number, lambda v: 0 <= v < math.inf, "must be >= 0 and finite")


def quiet_ray_startup() -> None:
    """Keep Ray's own lines off the terminal when a command starts or joins a Ray cluster: its
    "Token authentication is enabled ..." warning, "Started a local Ray instance", "Connected to
    Ray cluster" (each command says what it runs on, in its own words), and the report of a
    dashboard that did not start (``_NoDashboard``). Ray's other errors still show. Every
    subcommand (``main``, ``run_main``); nothing is imported."""
    for name, level in (("ray._private.worker", logging.WARNING),
                        ("ray._private.authentication.authentication_token_setup", logging.ERROR)):
        logging.getLogger(name).setLevel(level)
    services = logging.getLogger("ray._private.services")
    if not any(isinstance(f, _NoDashboard) for f in services.filters):
        services.addFilter(_NoDashboard())


class _NoDashboard(logging.Filter):
    """Drops Ray's lines about its dashboard process: the commands start Ray without a dashboard
    (``include_dashboard=False``), yet Ray starts its API server anyway and, when that dies at
    start (seen here under load: return code -6), logs five ERROR lines about dashboard.log and
    goes on without it. Nothing the user asked for failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "dashboard" not in record.getMessage()


def log_to_stderr() -> None:
    """A long-running command's log lines, as the manager writes them: time, logger, level, message."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


# ---- running a subcommand -------------------------------------------------------------------------
def one_line(message: object) -> str:
    """The first non-blank line of a message (exceptions from gRPC and Ray carry whole reports)."""
    for line in str(message).splitlines():
        if line.strip():
            return line.strip()
    return str(message).strip() or "failed"


def why_unreachable(details: object) -> str:
    """gRPC's reason for a failed connection on one line; "connection refused" (its commonest,
    buried in "failed to connect to all addresses; last error: ...") said plainly."""
    text = one_line(details)
    if "Connection refused" in text:
        return "connection refused (nothing listens there: is `kvpager manager` running, on that port?)"
    return text


def guarded(parser: Parser, run: Callable[[argparse.Namespace], Optional[int]], args: argparse.Namespace) -> int:
    """Run a subcommand, turning every way it can fail into one line and an exit status."""
    try:
        return run(args) or 0
    except UsageError as err:
        parser.error(str(err))
    except KeyboardInterrupt:
        return 130
    except Failure as err:
        print(f"{parser.prog}: {one_line(err)}", file=sys.stderr)
    except Exception as err:  # noqa: BLE001 (the top: nothing may escape as a traceback)
        if os.environ.get(DEBUG_ENV):
            traceback.print_exc()
        print(f"{parser.prog}: {type(err).__name__}: {one_line(err)}"
              f"{'' if os.environ.get(DEBUG_ENV) else f' ({DEBUG_ENV}=1 shows the traceback)'}", file=sys.stderr)
    return 1


def run_main(prog: str, module: Any, argv: Optional[Sequence[str]]) -> int:
    """The ``main`` of a subcommand module run on its own (``python -m kvpager.commands.demo``)."""
    parser = Parser(prog=prog, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    module.configure(parser)
    quiet_ray_startup()
    return _exit_code(lambda: guarded(parser, module.run, parser.parse_args(argv)))


def _exit_code(body: Callable[[], int]) -> int:
    try:
        return body()
    except SystemExit as exc:  # --help, or a usage error
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


# ---- wiring ---------------------------------------------------------------------------------------
# name: (module providing configure/run, one-line help)
COMMANDS = {
    "manager": ("kvpager.commands.manager", "serve the block manager over gRPC"),
    "worker": ("kvpager.commands.worker", "start cache workers on Ray and register them with a manager"),
    "generate": ("kvpager.commands.generate", "generate text with a local Hugging Face checkpoint"),
    "demo": ("kvpager.commands.demo", "serve a request mix end to end and check every token (what `make demo` runs)"),
    "stats": ("kvpager.commands.stats_view", "a live table of a running manager's pools, sequences and workers"),
    "bench": ("kvpager.commands.bench", "run a benchmark script of the repository's benchmarks/ folder"),
}


def build_parser(argv: Sequence[str]) -> tuple[Parser, dict[str, Parser]]:
    """The top parser with every subcommand listed; only the one ``argv`` names gets its flags."""
    parser = Parser(prog="kvpager", description=DESCRIPTION, epilog=TOP_EPILOG,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvpager {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parsers = {}
    for name, (module_name, summary) in COMMANDS.items():
        module = None
        if name == chosen:
            try:
                module = importlib.import_module(module_name)
            except ImportError as err:  # an optional dependency missing (torch, ray...)
                raise Failure(f"kvpager {name}: cannot load {module_name}: {err} (pip install 'kvpager[torch,ray]')")
        description = (module.__doc__ if module is not None else None) or summary
        p = sub.add_parser(name, help=summary, description=description, epilog=getattr(module, "EPILOG", EPILOG),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == chosen:
            module.configure(p)
            p.set_defaults(_run=module.run)
        parsers[name] = p
    return parser, parsers


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        try:
            parser, parsers = build_parser(argv)
        except Failure as err:
            print(one_line(err), file=sys.stderr)
            return 1
        args, extras = parser.parse_known_args(argv)
        if extras:  # say whose flags they are not
            parsers[args.command].error(f"unrecognized arguments: {' '.join(extras)}")
        quiet_ray_startup()
        return guarded(parsers[args.command], args._run, args)

    return _exit_code(body)


if __name__ == "__main__":
    sys.exit(main())
