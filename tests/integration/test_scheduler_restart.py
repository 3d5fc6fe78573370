"""The reference scheduler survives a kill -9 of the manager (--state-dir): it waits, sends the
same Step again with the same request id once the restarted manager answers, and finishes every
request with the tokens an undisturbed run gives. The worker (in this process) keeps its cache."""

from __future__ import annotations

import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from kvpager import client as C
from kvpager.scheduler import Request, SamplingParams, Scheduler
from kvpager.scheduler.reference import generate_contiguous
from kvpager.worker.cache_worker import CacheWorker, WorkerConfig
from kvpager.worker.model import Decoder, ModelConfig

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_q_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=128, vocab_size=128, seed=3)
BLOCK = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(port: int, state_dir: str, log) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpager", "manager", "--insecure", "--port", str(port), "--state-dir", state_dir,
         "--block-size", str(BLOCK), "--num-gpu-blocks", "0", "--watermark", "0",
         "--worker-heartbeat-timeout", "1"], stdout=subprocess.PIPE, stderr=log, text=True)
    assert re.search(r"listening on", proc.stdout.readline())
    return proc


def test_scheduler_carries_on_across_a_manager_kill_9(tmp_path):
    rng = random.Random(7)
    requests = []
    for i in range(12):
        prompt = [rng.randrange(MODEL.vocab_size) for _ in range(rng.randint(3, 12))]
        requests.append(Request(f"r{i}", prompt, SamplingParams(max_new_tokens=rng.randint(4, 12), n=rng.choice([1, 2]))))
    port, state_dir = _free_port(), str(tmp_path / "state")
    log = open(tmp_path / "manager.log", "w")
    procs = [_start(port, state_dir, log)]
    worker = CacheWorker(WorkerConfig(model=MODEL, block_size=BLOCK, num_gpu_blocks=48, num_cpu_blocks=64,
                                      manager_address=f"127.0.0.1:{port}"))
    worker.start()
    client = C.BlockManagerClient(f"127.0.0.1:{port}", timeout=5)
    calls, restarted = 0, threading.Event()

    def restart():
        time.sleep(0.5)
        procs.append(_start(port, state_dir, log))
        restarted.set()

    def runner(inp):
        nonlocal calls
        calls += 1
        logits = worker.execute_model(inp)
        if calls == 6:  # after this step's compute: the manager dies between two Steps
            procs[-1].send_signal(signal.SIGKILL)
            procs[-1].wait()
            threading.Thread(target=restart, daemon=True).start()
        return logits

    try:
        client.wait_ready()
        scheduler = Scheduler(client, runner, block_size=BLOCK, recover_timeout=30)
        before = client.get_stats().steps
        outputs = scheduler.run(requests)
        print("scheduler stats:", scheduler.stats.recoveries, scheduler.stats.restarts, scheduler.stats.steps)
        assert restarted.is_set() and len(procs) == 2
        expected = generate_contiguous(Decoder(MODEL), requests)
        for request in requests:
            assert outputs[request.request_id].samples == expected[request.request_id], request.request_id
        stats = client.get_stats()
        assert stats.steps > before and stats.running_sequences == stats.swapped_sequences == 0
        assert stats.gpu.used_blocks == 0
    finally:
        client.close()
        worker.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        log.close()
