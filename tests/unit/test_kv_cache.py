"""The worker's cache executes plans in the order that keeps data right, or rejects them whole, and
refuses model steps that name a block or slot outside it."""

import numpy as np
import pytest
import torch

from kvpager.step import StepInput
from kvpager.worker.block_plan import BlockMoves, BlockPlan
from kvpager.worker.kv_cache import CacheSpec, KVCache, PlanRejected

SPEC = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)


def fresh_cache() -> KVCache:
    cache = KVCache(SPEC, num_blocks=6, num_swap_blocks=4, device="cpu")
    gen = torch.Generator().manual_seed(0)
    cache.blocks.copy_(torch.randn(cache.blocks.shape, generator=gen))
    cache.swap_space.copy_(torch.randn(cache.swap_space.shape, generator=gen))
    return cache


def test_layout_is_block_major_and_layer_views_alias_it():
    cache = fresh_cache()
    assert cache.blocks.shape == (6, 2, 2, 2, 4, 4)
    assert SPEC.block_bytes == 2 * 2 * 2 * 4 * 4 * 4
    k, v = cache.layer(1)
    assert k.shape == (6, 2, 4, 4) and k.data_ptr() == cache.blocks[:, 1, 0].data_ptr()
    k[3, 1, 2] = 7.0
    assert torch.all(cache.blocks[3, 1, 0, 1, 2] == 7.0)


def test_plan_runs_swap_out_then_swap_in_then_copy():
    cache = fresh_cache()
    blocks, swap = cache.blocks.clone(), cache.swap_space.clone()
    # Cache block 3 leaves for swap block 0, swap block 1 arrives in cache block 3, then 3 is copied to 5.
    cache.execute(BlockPlan(swap_out=BlockMoves([3], [0]), swap_in=BlockMoves([1], [3]), copy=BlockMoves([3], [5])))
    assert torch.equal(cache.swap_space[0], blocks[3])
    assert torch.equal(cache.blocks[3], swap[1])
    assert torch.equal(cache.blocks[5], swap[1])
    untouched = [0, 1, 2, 4]
    assert torch.equal(cache.blocks[untouched], blocks[untouched])
    assert torch.equal(cache.swap_space[[1, 2, 3]], swap[[1, 2, 3]])


@pytest.mark.parametrize("plan, message", [
    (BlockPlan(swap_out=BlockMoves([6], [0])), "out of range"),
    (BlockPlan(swap_in=BlockMoves([0], [-1])), "out of range"),
    (BlockPlan(swap_out=BlockMoves([0], [0]), copy=BlockMoves([1, 2], [4, 4])), "written twice"),
    (BlockPlan(swap_out=BlockMoves([0, 1], [0])), "destinations"),
])
def test_bad_plan_is_rejected_whole(plan, message):
    cache = fresh_cache()
    blocks, swap = cache.blocks.clone(), cache.swap_space.clone()
    with pytest.raises(PlanRejected, match=message):
        cache.execute(plan)
    assert torch.equal(cache.blocks, blocks) and torch.equal(cache.swap_space, swap)


def decode_step(tables, slots) -> StepInput:
    return StepInput(step_id=3, plan_step_id=0, token_ids=[1] * len(slots), positions=[2] * len(slots),
                     slot_mapping=slots, query_lens=[1] * len(slots), context_lens=[3] * len(slots),
                     block_tables=tables, max_blocks=len(tables) // len(slots))


@pytest.mark.parametrize("tables", [[0, 5, 5, 1], np.array([0, 5, 5, 1], dtype="<i4"), np.array([0, 5, 5, 1])])
def test_a_step_inside_the_cache_passes_its_check(tables):
    fresh_cache().check_step(decode_step(tables, [0, 23]))   # blocks 0-5, slots 0-23: the last of each


@pytest.mark.parametrize("tables, slots, message", [
    ([0, 5, 6, 1], [0, 1], "row 1 names block 6"),
    (np.array([0, 5, 1, -1], dtype="<i4"), [0, 1], "row 1 names block -1"),   # negative, read as unsigned
    (np.array([0, -(2**40), 1, 2]), [0, 1], f"row 0 names block {-(2**40)}"),   # int64
    (np.array([0, 9, 5, 9, 5, 9, 1, 9], dtype="<i4")[::2], [0, 1], None),   # a strided view, inside
    (np.array([0, 1, 5, 1, 5, 1, 8, 1], dtype="<i4")[::2], [0, 1], "row 1 names block 8"),   # and not
    ([0, 1, 2, 3], [0, 24], "token 1 is written to slot 24, outside this cache's 24 slots"),
    ([0, 1, 2, 3], [-2, 3], "token 0 is written to slot -2"),
])
def test_a_step_naming_a_block_or_slot_outside_the_cache_is_refused(tables, slots, message):
    cache = fresh_cache()
    if message is None:
        cache.check_step(decode_step(tables, slots))
        return
    with pytest.raises(ValueError, match=message):
        cache.check_step(decode_step(tables, slots))
