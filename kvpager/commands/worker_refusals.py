"""The lines `kvpager worker` ends with when the block manager would refuse, or did refuse, its
group: a block size, tensor-parallel size or cache that does not fit the manager's, each naming
both values and the flags to change. ``worker_checks.check_manager_agrees`` gives them before Ray
starts; ``explain_refusal`` turns a refused registration, as it comes out of a Ray error
(``ray_error_cause``), into the same line.
"""

from __future__ import annotations

import re
from typing import Optional

from kvpager.commands import cli


def too_small(capacity: tuple[Optional[int], Optional[int]], pools: tuple[int, int]) -> bool:
    """Whether a known capacity (GPU, CPU blocks; None: not known yet) is below the manager's pools."""
    return any(have is not None and have < need for have, need in zip(capacity, pools))


def block_size_refusal(manager: str, manager_size: int, worker_size: int) -> str:
    return (f"block size mismatch: the block manager at {manager} uses --block-size {manager_size}, these workers "
            f"--block-size {worker_size}: start both with the same --block-size (KVPAGER_BLOCK_SIZE)")


def group_size_refusal(manager: str, group_size: int, worker_size: int) -> str:
    return (f"tensor-parallel size mismatch: the block manager at {manager} serves a group of {group_size} rank(s), "
            f"these workers --tensor-parallel-size {worker_size}: pass --tensor-parallel-size {group_size}, or "
            "restart the manager (it keeps the size of the first group that registered)")


def capacity_refusal(manager: str, capacity: tuple[Optional[int], Optional[int]], pools: tuple[int, int]) -> str:
    short = [(tier, have, need) for tier, have, need in zip(("gpu", "cpu"), capacity, pools)
             if have is not None and have < need]
    held = ", ".join(f"{have} {tier.upper()} blocks where its pool has {need}" for tier, have, need in short)
    flags = " and ".join(f"--num-{tier}-blocks {need}" for tier, _, need in short)
    return (f"cache smaller than the pools of the block manager at {manager}: each rank holds {held}; start the "
            f"workers with {flags} (or more), or the manager with --num-gpu-blocks 0 (pools sized from the workers)")


# What the manager says when it refuses a registration (manager/workers.py, manager/service.py),
# and the same line check_manager_agrees gives.
_REFUSALS = (
    (re.compile(r"block size (\d+) differs from the manager's (\d+)"),
     lambda m, manager: block_size_refusal(manager, int(m[2]), int(m[1]))),
    (re.compile(r"tensor_parallel_size (\d+) differs from the group's (\d+)"),
     lambda m, manager: group_size_refusal(manager, int(m[2]), int(m[1]))),
    (re.compile(r"capacity (\d+) GPU / (\d+) CPU blocks is below the manager's pools \((\d+) / (\d+)\)"),
     lambda m, manager: capacity_refusal(manager, (int(m[1]), int(m[2])), (int(m[3]), int(m[4])))),
)


def explain_refusal(cause: str, manager: str) -> str:
    """One line for a failed start: a registration the manager refused, in the words of
    ``check_manager_agrees``; anything else as it came."""
    for pattern, explain in _REFUSALS:
        match = pattern.search(cause)
        if match:
            return explain(match, manager)
    return f"the workers did not start: {cause}"


_RPC_STATUS = re.compile(r'status = StatusCode\.(\w+)\s+details = "([^"]*)"')


def ray_error_cause(err: BaseException) -> str:
    """The one-line reason inside a Ray error. A failed registration raised a grpc.RpcError in the
    actor, which Ray cannot pickle: its status and details survive only in the traceback text."""
    text = getattr(err, "traceback_str", "") or str(err)
    statuses = _RPC_STATUS.findall(text)
    if statuses:
        code, details = statuses[-1]
        return f"{code}: {details}"
    finals = [line for line in text.splitlines() if line.strip() and not line[0].isspace()
              and not line.startswith(("Traceback", "ray::", "\x1b"))]
    return finals[-1] if finals else cli.one_line(err)
