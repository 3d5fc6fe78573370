"""The pools' count of each tenant's blocks (``BlockPool.owned``, what a quota of GPU blocks reads in
O(1)) stays exact on the paths that move it away from the step that changed it: a tentative step
rolled back while another tenant's call is current, a shared block that only a pin holds, the
loss of every sequence, and a manager restored from a snapshot. The invariant checker recounts
it (with ``tenancy.usage``) after each scenario."""

from __future__ import annotations

import pytest

from kvpager.manager import BlockManager, ManagerConfig, tenancy
from kvpager.manager.operations import SwapOutOp
from kvpager.manager.snapshot import manager_state, restore_manager

T, U = "t", "u"
P, C, X = tenancy.qualify(T, "p"), tenancy.qualify(T, "c"), tenancy.qualify(U, "x")
SPACE = {T: tenancy.qualify_namespace(T, ""), U: tenancy.qualify_namespace(U, "")}  # as the service maps them


def manager() -> BlockManager:
    return BlockManager(ManagerConfig(block_size=2, num_gpu_blocks=17, num_cpu_blocks=8))


def counts(m: BlockManager) -> tuple[dict[str, int], dict[str, int]]:
    m.check_invariants()
    return dict(m.gpu.owned), dict(m.cpu.owned)


@pytest.mark.parametrize("ok", [True, False])
def test_a_tentative_step_finished_during_another_tenants_call_counts_for_its_own_tenant(ok):
    m = manager()
    m.allocate(P, [1, 2, 3], namespace=SPACE[T])   # 2 blocks
    m.fork(P, C)                               # shares both: still 2
    step = m.step([SwapOutOp([C])], hold_open=True).step_id   # c's 2 GPU references dropped: pinned
    assert counts(m) == ({T: 2}, {T: 2})
    m.allocate(X, [9, 9, 9, 9, 9], namespace=SPACE[U])   # u: 3 blocks
    m.free(P)                                  # only the pins hold t's GPU blocks now: no table names them
    assert counts(m) == ({U: 3}, {T: 2})
    m.admit = tenancy.QuotaCheck(m, U, 3)      # u's call is current while t's step finishes
    m.finish_tentative(step, ok)
    assert counts(m) == (({U: 3}, {T: 2}) if ok else ({T: 2, U: 3}, {}))
    with pytest.raises(tenancy.ResourceExhausted, match="'u' holds 3 of its quota of 3"):
        m.admit("allocate", 1)


def test_losing_every_sequence_leaves_no_tenant_a_block():
    m = manager()
    m.allocate(P, [1, 2, 3], namespace=SPACE[T])
    m.allocate(X, [1, 2, 3], namespace=SPACE[U])   # the same prompt in another tenant's space: nothing shared
    m.swap_out([X])
    assert counts(m) == ({T: 2}, {U: 2})
    m.lose_all(1)
    assert counts(m) == ({}, {})


def test_a_restored_manager_counts_each_tenants_blocks_again():
    m = manager()
    m.allocate(P, [1, 2, 3], namespace=SPACE[T])
    m.fork(P, C)
    m.allocate(X, [4, 5, 6, 7, 8], namespace=SPACE[U])
    m.swap_out([X])
    restored = restore_manager(manager_state(m), m.config)
    assert counts(restored) == counts(m) == ({T: 2}, {U: 3})
