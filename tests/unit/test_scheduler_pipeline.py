"""The scheduler's rule for sending a Step while another computes: never while an append may copy
on write (forked samples before each has appended its first token)."""

from kvpager.scheduler.pipeline import _may_copy_on_write
from kvpager.scheduler.request import Group, Request, SamplingParams, SeqState

PROMPT = [5, 6, 7, 8, 9]


def group_of(n: int, cached: list[int], finished: tuple[int, ...] = ()) -> Group:
    group = Group(Request("r", PROMPT, SamplingParams(n=n, max_new_tokens=8)))
    for i, num_cached in enumerate(cached):
        seq = SeqState(f"r/{i}", list(PROMPT), num_cached=num_cached)
        seq.finish_reason = "stop" if i in finished else ""
        group.seqs.append(seq)
    return group


def test_one_sequence_never_copies_on_write():
    assert not _may_copy_on_write(group_of(1, [0]))
    assert not _may_copy_on_write(group_of(1, [len(PROMPT)]))


def test_forked_samples_may_copy_until_each_appended_its_first_token():
    assert _may_copy_on_write(group_of(3, [0, 0, 0]))                    # prompt not computed yet
    assert _may_copy_on_write(group_of(3, [5, 5, 5]))                    # the first appends are next
    assert _may_copy_on_write(group_of(3, [6, 5, 6]))                    # one answer not taken yet
    assert not _may_copy_on_write(group_of(3, [6, 6, 7]))                # each has its own last block
    assert not _may_copy_on_write(group_of(3, [6, 5, 6], finished=(1,)))  # the laggard finished
