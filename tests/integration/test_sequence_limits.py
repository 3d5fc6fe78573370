"""What live sequences may make the manager hold (docs/design.md, "Replies that never lie";
docs/security.md, "Tenants"), on real servers on 127.0.0.1: a fork takes no block, yet the manager
keeps a copy of its parent's block table (measured: 8 bytes an entry, 512 KiB for a fork of a
1M-token sequence at block size 16, plus ~260 bytes a sequence), so forks are bounded by
``max_sequences`` and ``max_block_table_entries``, and each tenant by its ``quota_sequences``.
A refusal is RESOURCE_EXHAUSTED naming the limit, nothing applied, the server serving on;
freeing makes room again; the counts are rebuilt by recovery from the write-ahead log.
Invariants (which recount the counts) are checked after each scenario."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import signal
import subprocess
import sys

import pytest

from kvpager import auth
from kvpager import client as C
from kvpager import errors
from kvpager.manager import ManagerConfig
from kvpager.manager.block_manager import BlockManager
from kvpager.manager.service import create_server
from kvpager.manager.snapshot import manager_state
from tests.support.state import served_fingerprint
from tests.support.tenant_server import tenant_clients
from tests.support.tls import CA

from ..conftest import running_server

LIMITED = ManagerConfig(block_size=4, num_gpu_blocks=64, num_cpu_blocks=32, watermark=0.0, max_sequences=4)


def refusal(call) -> str:
    with pytest.raises(errors.ResourceExhausted) as info:
        call()
    return str(info.value)


def test_max_sequences_refuses_forks_and_allocates_and_freeing_makes_room():
    with running_server(LIMITED) as (client, service):
        client.allocate("p", num_tokens=16)
        for i in range(3):
            client.fork("p", f"c{i}")
        before = served_fingerprint(service)
        message = refusal(lambda: client.fork("p", "c3"))
        assert message == ("fork 'p' -> 'c3': the manager holds 4 sequences, its limit (max_sequences 4); "
                           "free sequences first")
        assert "max_sequences 4" in refusal(lambda: client.allocate("x", num_tokens=1))
        assert served_fingerprint(service) == before                  # nothing applied
        client.append("p", num_tokens=1)                              # serving on
        client.swap_out(["c0"])                                       # a swapped sequence still counts
        assert "max_sequences" in refusal(lambda: client.fork("p", "c3"))
        client.free("c0")
        assert client.fork("p", "c3").child_seq_id == "c3"           # room again
        assert service.manager.seqs.num_entries == 5 + 4 + 4 + 5   # p appended to before c3 was forked


def test_a_refused_fork_in_a_step_follows_the_steps_refusal_semantics():
    with running_server(LIMITED) as (client, service):
        client.allocate("p", num_tokens=16)
        client.fork("p", "c0")
        client.fork("p", "c1")
        # One at a time: the first fork fills the last slot, the second is refused alone; the free
        # after it makes room for the third.
        step = client.step([C.fork_op("p", "f0"), C.fork_op("p", "f1"), C.free_op("c0"), C.fork_op("p", "f2")])
        codes = [r.code for r in step.results]
        assert step.applied and codes[0] == codes[2] == codes[3] == 0
        err = C.result_error(step.results[1])
        assert isinstance(err, errors.ResourceExhausted) and "max_sequences 4" in str(err)
        assert sorted(s.seq_id for s in service.manager.seqs.values()) == ["c1", "f0", "f2", "p"]
        # All or nothing: the refused fork undoes the whole step (the free before it included).
        before = served_fingerprint(service)
        step = client.step([C.free_op("c1"), C.fork_op("p", "g0"), C.fork_op("p", "g1")], all_or_nothing=True)
        assert not step.applied and C.result_error(step.results[2]).code == "RESOURCE_EXHAUSTED"
        assert served_fingerprint(service) == before
        with service.lock:
            service.manager.check_invariants()


def test_max_block_table_entries_bounds_forks_of_long_sequences():
    config = dataclasses.replace(LIMITED, max_sequences=100, max_block_table_entries=10)
    with running_server(config) as (client, service):
        client.allocate("p", num_tokens=16)        # 4 entries
        client.fork("p", "c0")                     # 8
        before = served_fingerprint(service)
        message = refusal(lambda: client.fork("p", "c1"))
        assert message == ("fork 'p' -> 'c1': its block table of 4 entries would take the live sequences' tables to "
                           "12 entries, over the limit (max_block_table_entries 10); free sequences first")
        assert "max_block_table_entries 10" in refusal(lambda: client.allocate("x", num_tokens=9))   # 3 entries
        assert served_fingerprint(service) == before
        client.allocate("x", num_tokens=8)         # 2 entries: 10, within the limit
        client.free("c0")
        client.fork("p", "c1")                     # room again
        # Appends lengthen tables (each new entry a new block of the pool); the count follows them.
        client.append("x", num_tokens=1)
        assert service.manager.seqs.num_entries == 4 + 4 + 3


def test_lost_sequences_count_until_they_are_freed():
    """Sequences lost with a replaced worker group keep their ids (DATA_LOSS) until freed: they
    count against max_sequences, so repeated losses cannot grow the manager's memory either."""
    m = BlockManager(dataclasses.replace(LIMITED, max_sequences=2))
    m.allocate("a", num_tokens=4)
    m.allocate("b", num_tokens=4)
    assert m.lose_all(epoch=1) == 2
    with pytest.raises(errors.ResourceExhausted, match=r"holds 2 sequences \(2 of them lost, until freed\)"):
        m.allocate("c", num_tokens=4)
    m.free("a")
    m.allocate("c", num_tokens=4)
    m.check_invariants()


# ---- tenants --------------------------------------------------------------------------------------
Q, B = (f"{name}-token-0123456789abcdef" for name in ("q", "b"))
TOKENS = {"tokens": [
    {"token": Q, "tenant": "q", "role": "scheduler", "quota_sequences": 2},
    {"token": B, "tenant": "b", "role": "scheduler"},
]}


@pytest.fixture
def tenants():
    """(clients by tenant, service) of a TLS + token server; invariants checked at the end."""
    ca = CA.create()
    cert = ca.issue("manager")
    config = ManagerConfig(block_size=4, num_gpu_blocks=64, num_cpu_blocks=16, watermark=0.0, max_sequences=6)
    with tenant_clients(config, TOKENS, cert, ca.cert, {"q": Q, "b": B}) as served:
        yield served


def test_a_tenants_sequence_quota_refuses_only_that_tenant(tenants):
    clients, service = tenants
    q, b = clients["q"], clients["b"]
    q.allocate("p", num_tokens=8)
    q.fork("p", "c")
    before = served_fingerprint(service)
    message = refusal(lambda: q.fork("p", "d"))
    assert message == ("fork 'p' -> 'd': tenant 'q' holds 2 live sequences, its quota of 2 (quota_sequences); "
                       "free sequences first")
    assert "quota_sequences" in refusal(lambda: q.allocate("d", num_tokens=1))
    step = q.step([C.fork_op("p", "d")])
    assert step.applied and C.result_error(step.results[0]).code == "RESOURCE_EXHAUSTED"
    assert served_fingerprint(service) == before
    # The other tenant is not limited by q's quota (only by the manager's max_sequences, 6).
    b.allocate("p", num_tokens=8)
    for i in range(3):
        b.fork("p", f"c{i}")
    assert "max_sequences 6" in refusal(lambda: b.fork("p", "c3"))
    # Freeing gives q its room back.
    q.free("c")
    q.fork("p", "d")
    assert service.manager.seqs.owned == {"q": 2, "b": 4}
    assert auth.TokenTable.from_json(TOKENS).sequence_quotas() == {"q": 2}
    with pytest.raises(auth.CredentialError, match="quota_sequences must be an integer >= 0"):
        auth.TokenTable.from_json({"tokens": [{"token": Q, "tenant": "q", "role": "scheduler",
                                               "quota_sequences": -1}]})


# ---- recovery -------------------------------------------------------------------------------------
@contextlib.contextmanager
def serving(config: ManagerConfig, **kwargs):
    server, port, service, _ = create_server(config, **kwargs)
    server.start()
    try:
        with C.BlockManagerClient(f"127.0.0.1:{port}", timeout=10) as client:
            yield client, service
    finally:
        server.stop(0).wait()
        service.close()


def test_recovery_rebuilds_the_counts_and_replays_the_quotas_refusals(tmp_path):
    """In process, tenant "" (no tokens) with a sequence quota: its refusals are logged as the block
    quota's are and replayed as they were; the counts come from the recovered table."""
    config = dataclasses.replace(LIMITED, max_sequences=10, state_dir=str(tmp_path / "state"), fsync="never")
    with serving(config, sequence_quotas={"": 3}) as (client, service):
        client.allocate("p", num_tokens=16)
        step = client.step([C.fork_op("p", "c0"), C.fork_op("p", "c1"), C.fork_op("p", "c2"),
                            C.free_op("c0"), C.fork_op("p", "c3")])
        assert [r.code != 0 for r in step.results] == [False, False, True, False, False]
        live = manager_state(service.manager)
    # Restarted without the quota: the refusal is replayed from the log (else the step would give
    # other outcomes, and recovery would refuse to start); the counts are the table's.
    with serving(config) as (client, service):
        assert manager_state(service.manager) == live
        assert service.manager.seqs.owned == {"": 3} and service.manager.seqs.num_entries == 12
        service.manager.check_invariants()
    with serving(config, sequence_quotas={"": 3}) as (client, service):
        assert "quota_sequences" in refusal(lambda: client.fork("p", "c4"))


def test_a_restarted_manager_process_still_holds_its_sequences_to_max_sequences(tmp_path):
    """A real manager process with --state-dir and --max-sequences, killed (-9) at its limit."""
    state, log_path = str(tmp_path / "state"), str(tmp_path / "m.log")

    def start() -> tuple[subprocess.Popen, str]:
        with open(log_path, "a") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvpager", "manager", "--insecure", "--port", "0", "--state-dir", state,
                 "--block-size", "4", "--num-gpu-blocks", "64", "--num-cpu-blocks", "16", "--max-sequences", "3"],
                stdout=subprocess.PIPE, stderr=log, text=True)
        match = re.search(r"listening on (\S+)", proc.stdout.readline())
        if match is None:
            proc.kill()
            proc.wait()
            with open(log_path) as f:
                raise AssertionError(f"the manager did not start:\n{f.read()[-3000:]}")
        return proc, match.group(1)

    proc, target = start()
    try:
        with C.BlockManagerClient(target, timeout=10) as client:
            client.allocate("p", num_tokens=8)
            client.fork("p", "c0")
            client.fork("p", "c1")
            assert "max_sequences 3" in refusal(lambda: client.fork("p", "c2"))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    proc, target = start()
    try:
        with C.BlockManagerClient(target, timeout=10) as client:
            assert "the manager holds 3 sequences" in refusal(lambda: client.fork("p", "c2"))
            client.free("c0")
            client.fork("p", "c2")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
