"""A live view of a running block manager (`kvpager stats`): its GPU and CPU pools, utilization,
fragmentation, sequences, prefix-cache hits, swaps, step rate and workers, from GetStats.

On a terminal the table is redrawn in place every --interval seconds; otherwise (a pipe, a
file) each refresh is printed as its own block, separated by a blank line. A manager that
answers UNAVAILABLE (its pools wait for the workers to register) is shown as such and
watched until it serves; a manager that cannot be reached at the start ends the command.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Optional, TextIO

from kvpager.commands import cli, security
from kvpager import client as C
from kvpager import errors
from kvpager.v1 import block_manager_pb2 as pb

BAR_WIDTH = 32
HOME, CLEAR_LINE, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"


def configure(parser: argparse.ArgumentParser) -> None:
    cli.flag(parser, "--manager", env="KVPAGER_MANAGER_ADDRESS", type=cli.address, default="127.0.0.1:50051",
             help="the block manager to watch")
    cli.flag(parser, "--interval", env="KVPAGER_STATS_INTERVAL", type=cli.positive_float, default=1.0,
             metavar="SECONDS", help="seconds between refreshes")
    cli.flag(parser, "--once", env="KVPAGER_STATS_ONCE", type=bool, default=False,
             help="print one table and exit (same as --count 1)")
    cli.flag(parser, "--count", env="KVPAGER_STATS_COUNT", type=cli.positive_int, metavar="N",
             default_help="unset: until Ctrl-C", help="exit after N refreshes")
    security.client_security_flags(parser)


@dataclass(slots=True)
class Sample:
    """One GetStats answer and when it came (for the step rate between refreshes)."""

    stats: pb.GetStatsResponse
    at: float


def ratio(part: int, whole: int) -> str:
    return f"{part / whole:6.1%} ({part}/{whole})" if whole else "     - (0/0)"


def bar(tier: pb.TierStats, width: int = BAR_WIDTH) -> str:
    """Used blocks as '#', cached (evictable) ones as '+', free ones as '.'."""
    if tier.total_blocks <= 0:
        return "[" + " " * width + "]"
    used = round(width * tier.used_blocks / tier.total_blocks)
    cached = min(width - used, round(width * tier.cached_blocks / tier.total_blocks))
    return "[" + "#" * used + "+" * cached + "." * (width - used - cached) + "]"


def render(target: str, sample: Sample, previous: Optional[Sample]) -> list[str]:
    """The table's lines for one GetStats answer (``previous``: the last refresh's, for steps/s)."""
    s = sample.stats
    rate = "-"
    if previous is not None and sample.at > previous.at and s.steps >= previous.stats.steps:
        rate = f"{(s.steps - previous.stats.steps) / (sample.at - previous.at):.1f}"
    lines = [
        f"kvpager manager {target}  block size {s.block_size}  prefix caching {'on' if s.prefix_caching else 'off'}"
        f"  watermark {s.watermark_blocks} blocks  {time.strftime('%H:%M:%S')}",
        "",
        f"{'tier':4s} {'total':>8s} {'used':>8s} {'free':>8s} {'cached':>8s} {'usage':>7s}  "
        f"utilization (# used, + cached, . free)",
    ]
    for name, tier in (("gpu", s.gpu), ("cpu", s.cpu)):
        usage = tier.used_blocks / tier.total_blocks if tier.total_blocks else 0.0
        lines.append(f"{name:4s} {tier.total_blocks:8d} {tier.used_blocks:8d} {tier.free_blocks:8d} "
                     f"{tier.cached_blocks:8d} {usage:7.1%}  {bar(tier)}")
    lines += [
        "",
        f"fragmentation  {s.internal_fragmentation:.1%} of the used GPU blocks' slots unfilled",
        f"sequences      {s.running_sequences} running (GPU), {s.swapped_sequences} swapped (CPU)",
        f"prefix cache   tokens {ratio(s.prefix_hit_tokens, s.prefix_query_tokens)}   "
        f"blocks {ratio(s.prefix_hit_blocks, s.prefix_query_blocks)}   {s.evictions} evictions",
        f"swaps          {s.preemptions} preemptions, {s.blocks_swapped_out} blocks out, "
        f"{s.blocks_swapped_in} in; {s.cow_copies} copy-on-write copies",
        f"steps          {s.steps} in all, {rate} per second since the last refresh",
        f"workers        {s.workers_registered}/{s.workers_expected} registered"
        + ("" if s.workers_expected else " (none yet)"),
    ]
    return lines


def render_waiting(target: str, message: str) -> list[str]:
    return [f"kvpager manager {target}  {time.strftime('%H:%M:%S')}", "", f"not serving stats: {message}"]


class Screen:
    """Redraws in place on a terminal; prints blocks separated by blank lines elsewhere."""

    def __init__(self, out: TextIO, live: bool = True) -> None:
        self.out = out
        self.tty = live and out.isatty()
        self.frames = 0

    def show(self, lines: list[str]) -> None:
        if self.tty:
            self.out.write(HOME + "".join(line + CLEAR_LINE + "\n" for line in lines) + CLEAR_BELOW)
        else:
            self.out.write(("\n" if self.frames else "") + "\n".join(lines) + "\n")
        self.out.flush()
        self.frames += 1


def poll(client: C.BlockManagerClient) -> tuple[Optional[Sample], str]:
    """(a sample, "") or (None, why the manager gave no stats)."""
    try:
        stats = client.get_stats()
        if not stats.gpu.total_blocks:  # it answers, but its pools wait for the workers
            return None, (f"no block pool yet: it is sized from the workers' capacity once every rank registered "
                          f"({stats.workers_registered} of {stats.workers_expected or '?'} so far)")
        return Sample(stats, time.monotonic()), ""
    except errors.Unavailable as err:
        try:
            client.ping()
        except errors.ManagerError:
            return None, f"manager unreachable ({cli.one_line(err)}); retrying"
        return None, cli.one_line(err)  # it answers, but has no pools yet
    except errors.ManagerError as err:
        return None, f"{type(err).__name__}: {cli.one_line(err)}"


def run(args: argparse.Namespace, out: Optional[TextIO] = None) -> int:
    out = out or sys.stdout
    # --once is --count 1: a --count typed on the command line wins over KVPAGER_STATS_ONCE.
    once = args.once and not (args.count is not None and cli.outranks(args, "count", "once"))
    count = 1 if once else args.count
    timeout = min(5.0, max(1.0, args.interval))
    with C.BlockManagerClient(args.manager, timeout=timeout, **security.client_security(args)) as client:
        try:
            client.ping()
        except errors.ManagerError as err:
            if err.code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):  # reached, but refused (--auth-token)
                raise cli.Failure(f"the block manager at {args.manager} refused the call: {err.code}: "
                                  f"{cli.one_line(err)}") from err
            raise cli.Failure(f"cannot reach the block manager at {args.manager}: {cli.why_unreachable(err)}") from err
        screen, previous, shown = Screen(out, live=count != 1), None, 0
        if screen.tty:
            out.write("\x1b[2J")  # start from a clear screen; later frames overwrite in place
        while True:
            started = time.monotonic()
            sample, why = poll(client)
            screen.show(render(args.manager, sample, previous) if sample else render_waiting(args.manager, why))
            previous = sample or previous
            shown += 1
            if count is not None and shown >= count:
                return 0
            time.sleep(max(0.0, args.interval - (time.monotonic() - started)))


def main(argv: list[str] | None = None) -> int:
    return cli.run_main("kvpager stats", sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
