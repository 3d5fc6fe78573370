"""16 client threads hammer one server; the manager's state stays consistent."""

from __future__ import annotations

import random
import threading

from kvpager import client as C
from kvpager import errors
from kvpager.manager import ManagerConfig

from ..conftest import running_server

THREADS = 16
ROUNDS = 60
SHARED_PREFIX = list(range(1000, 1032))  # two full blocks every thread's prompts may share


def _hammer(target: str, thread: int, failures: list[BaseException]) -> None:
    rng = random.Random(thread)
    live: list[str] = []
    swapped: set[str] = set()
    expected_errors = (errors.ResourceExhausted, errors.FailedPrecondition)
    try:
        with C.BlockManagerClient(target, timeout=30) as client:
            for i in range(ROUNDS):
                action = rng.random()
                try:
                    if action < 0.3 or not live:
                        seq = f"t{thread}-{i}"
                        prompt = (SHARED_PREFIX if rng.random() < 0.5 else []) + [rng.randrange(50) for _ in range(rng.randint(1, 40))]
                        client.allocate(seq, token_ids=prompt)
                        live.append(seq)
                    elif action < 0.55:
                        seq = rng.choice(live)
                        if seq not in swapped:
                            client.append(seq, token_ids=[rng.randrange(50) for _ in range(rng.randint(1, 3))])
                    elif action < 0.65:
                        parent = rng.choice(live)
                        if parent not in swapped:
                            child = f"{parent}.f{i}"
                            client.fork(parent, child)
                            live.append(child)
                    elif action < 0.75:
                        seq = rng.choice(live)
                        if seq in swapped:
                            client.swap_in([seq])
                            swapped.discard(seq)
                        else:
                            client.swap_out([seq])
                            swapped.add(seq)
                    elif action < 0.9:
                        running = [s for s in live if s not in swapped]
                        ops = [C.append_op(s, num_tokens=1) for s in running[:8]]
                        r = client.step(ops, all_or_nothing=rng.random() < 0.3)
                        for res in r.results:
                            err = C.result_error(res)
                            assert err is None or isinstance(err, (*expected_errors, errors.Aborted)), err
                    else:
                        seq = live.pop(rng.randrange(len(live)))
                        swapped.discard(seq)
                        client.free(seq)
                except expected_errors:
                    pass
            for seq in live:
                client.free(seq)
    except BaseException as exc:  # reported by the main thread
        failures.append(exc)


def test_sixteen_threads_keep_invariants():
    config = ManagerConfig(block_size=16, num_gpu_blocks=400, num_cpu_blocks=200, watermark=0.01)
    with running_server(config, max_workers=THREADS) as (client, service):
        failures: list[BaseException] = []
        threads = [threading.Thread(target=_hammer, args=(client.target, t, failures)) for t in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a client thread hung"
        assert not failures, failures[0]
        with service.lock:
            service.manager.check_invariants()
        s = client.get_stats()
        assert s.running_sequences == s.swapped_sequences == 0
        assert s.gpu.used_blocks == 0 and s.cpu.used_blocks == 0
        assert s.gpu.free_blocks + s.gpu.cached_blocks == s.gpu.total_blocks
        assert s.prefix_hit_tokens > 0
