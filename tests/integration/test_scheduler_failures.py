"""The reference scheduler when the manager refuses or fails a Step, against a real manager on a
loopback port (the runner is a stand-in that returns fixed logits or ids): an admission refused
for room with n > 1 waits without losing the requests admitted beside it; a preemption whose
freeing Step fails keeps its victim where the recovery finds it; a restarted request streams
nothing twice; appends refused by a tenant's quota, with the pool roomy, preempt a group. After
each, every request has its output and the manager holds nothing."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

from kvpager import auth, errors
from kvpager import client as C
from kvpager.manager import ManagerConfig
from kvpager.manager.service import create_server
from kvpager.scheduler import Request, SamplingParams, Scheduler
from kvpager.step import WorkerDied

TOKEN, ADMIN = "quota-token-0123456789abcdef", "admin-token-0123456789abcdef"


@contextlib.contextmanager
def manager(config: ManagerConfig, tokens=None):
    """(client, admin client) of a manager on 127.0.0.1; its invariants checked at the end."""
    server, port, service, _ = create_server(config, "127.0.0.1:0", tokens=tokens)
    server.start()
    try:
        with C.BlockManagerClient(f"127.0.0.1:{port}", token=TOKEN if tokens else None) as client, \
                C.BlockManagerClient(f"127.0.0.1:{port}", token=ADMIN if tokens else None) as admin:
            yield client, admin
        with service.lock:
            service.manager.check_invariants()
    finally:
        server.stop(None)
        service.close()


def quota_tokens(quota: int) -> auth.TokenTable:
    """A scheduler token of tenant q with a quota of ``quota`` GPU blocks, and an admin token."""
    return auth.TokenTable.from_json({"tokens": [
        {"token": TOKEN, "tenant": "q", "role": "scheduler", "quota_blocks": quota},
        {"token": ADMIN, "tenant": "q", "role": "admin"}]})


def ids_runner(step):
    """Greedy: token 7 for every sequence that computed something."""
    return torch.tensor([7] * sum(1 for q in step.query_lens if q > 0))


def holds_nothing(admin) -> bool:
    stats = admin.get_stats()
    return stats.running_sequences == 0 and stats.swapped_sequences == 0 and stats.gpu.used_blocks == 0


def test_an_admission_refused_for_room_with_samples_waits_and_loses_no_other_request():
    # The tenant's quota (4 blocks) refuses B's prompt after A's: the scheduler saw the pool's
    # room, not the quota's (as when another scheduler takes the room between Steps). B's forks
    # then fail NOT_FOUND; C, admitted in the same Step, must still run.
    with manager(ManagerConfig(block_size=4, num_gpu_blocks=64, num_cpu_blocks=16, watermark=0.0),
                 quota_tokens(4)) as (client, admin):
        requests = [Request("A", list(range(1, 9)), SamplingParams(max_new_tokens=3)),         # 2 blocks
                    Request("B", list(range(20, 29)), SamplingParams(max_new_tokens=3, n=2)),  # 3 blocks, a fork
                    Request("C", list(range(40, 44)), SamplingParams(max_new_tokens=1))]       # 1 block
        outputs = Scheduler(client, ids_runner, block_size=4).run(requests)
        assert sorted(outputs) == ["A", "B", "C"]
        assert [len(s) for s in outputs["B"].samples] == [3, 3]
        assert holds_nothing(admin)


def test_a_preemption_whose_freeing_step_fails_keeps_its_victim_for_the_recovery():
    # One CPU block: the victim's swap-out is refused, so it is freed to restart; that Step fails
    # UNAVAILABLE once (the manager unreachable), and the recovery must still find the victim.
    with manager(ManagerConfig(block_size=4, num_gpu_blocks=8, num_cpu_blocks=1, watermark=0.0)) as (client, admin):
        scheduler = Scheduler(client, ids_runner, block_size=4, recover_timeout=2)
        send = scheduler._link.step
        seen = {"refused swap-out": False, "failed free": False}

        def step(ops, timeout):
            kinds = {op.WhichOneof("op") for op in ops}
            if seen["refused swap-out"] and not seen["failed free"] and kinds == {"free"}:
                seen["failed free"] = True
                raise errors.Unavailable("the manager is unreachable (injected)")
            reply = send(ops, timeout)
            if kinds == {"swap_out"} and reply.results[0].code != 0:
                seen["refused swap-out"] = True
            return reply

        scheduler._link.step = step
        requests = [Request(f"r{i}", [10 * i + j for j in range(4)], SamplingParams(max_new_tokens=12))
                    for i in range(3)]
        outputs = scheduler.run(requests)
        assert seen["failed free"] and scheduler.stats.recoveries == 1
        assert sorted(outputs) == ["r0", "r1", "r2"]
        assert all(len(outputs[r].samples[0]) == 12 for r in outputs)
        assert holds_nothing(admin)


def test_a_restarted_request_streams_no_token_twice():
    # n = 2, seeded sampling over equal logits: sample 0 stops first; then the workers die once
    # and the request restarts from scratch. Each sample's tokens, and its end, are streamed once.
    with manager(ManagerConfig(block_size=4, num_gpu_blocks=64, num_cpu_blocks=16, watermark=0.0)) as (client, admin):
        def runner(fail_at=None):
            calls = [0]

            def run(step):
                calls[0] += 1
                if calls[0] == fail_at:
                    raise WorkerDied("the workers died (injected)")
                return torch.zeros(sum(1 for q in step.query_lens if q > 0), 6)
            return run

        for seed in range(200):   # a seed whose sample 0 stops at least 4 tokens before sample 1
            params = SamplingParams(max_new_tokens=40, n=2, temperature=1.0, seed=seed, stop_token_ids=(0,))
            out = Scheduler(client, runner(), block_size=4).run([Request(f"probe{seed}", [1, 2, 3], params)])
            lengths = [len(s) for s in out[f"probe{seed}"].samples]
            if out[f"probe{seed}"].finish_reasons[0] == "stop" and lengths[1] - lengths[0] >= 4:
                break
        else:
            pytest.fail("no seed ends sample 0 first")
        streamed = []
        scheduler = Scheduler(client, runner(fail_at=lengths[0] + 2), block_size=4,
                              on_token=lambda rid, i, token, finish: streamed.append((i, token, finish)))
        result = scheduler.run([Request("r", [1, 2, 3], params)])["r"]
        assert scheduler.stats.recoveries == 1 and [len(s) for s in result.samples] == lengths
        assert Counter(i for i, _, _ in streamed) == {0: lengths[0], 1: lengths[1]}
        assert [i for i, _, finish in streamed if finish] == [0, 1]
        assert [t for i, t, _ in streamed if i == 0] == result.samples[0]
        assert holds_nothing(admin)


def test_appends_refused_by_the_tenants_quota_preempt_a_group_though_the_pool_has_room():
    # Three requests grow to 4 blocks each against a quota of 6, in a pool of 63: only the
    # Steps' refusals show the scheduler it is short; swapping a group out (swapped blocks do not
    # count against the quota) lets the others finish, then it comes back.
    with manager(ManagerConfig(block_size=4, num_gpu_blocks=64, num_cpu_blocks=32, watermark=0.0),
                 quota_tokens(6)) as (client, admin):
        requests = [Request(f"r{i}", list(range(10 * i, 10 * i + 4)), SamplingParams(max_new_tokens=10))
                    for i in range(3)]
        scheduler = Scheduler(client, ids_runner, block_size=4)
        outputs = scheduler.run(requests)
        assert sorted(outputs) == ["r0", "r1", "r2"] and all(len(outputs[r].samples[0]) == 10 for r in outputs)
        assert scheduler.stats.preemptions >= 1
        assert holds_nothing(admin)
