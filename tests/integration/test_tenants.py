"""Tenants (docs/security.md, "Tenants"), on a real server on 127.0.0.1 with TLS and tokens:
another tenant's sequences answer NOT_FOUND exactly as a missing id does, for every RPC and
Step operation naming one; seq ids and request ids are per tenant; the prefix cache is not shared
across tenants; GetStats shows a scheduler its own tenant and an admin every tenant; block
quotas refuse what would go over them, nothing applied. Invariants are checked after each test."""

from __future__ import annotations


import pytest

from kvpager import auth
from kvpager import client as C
from kvpager import errors
from kvpager.manager import ManagerConfig, tenancy
from tests.support.state import served_fingerprint
from tests.support.tenant_server import tenant_clients
from tests.support.tls import CA

A, A2, B, EMPTY, QUOTA, SEQUENCES, ADMIN = (f"{name}-token-0123456789abcdef" for name in
                                             ("a", "a2", "b", "empty", "quota", "sequences", "admin"))
TOKENS = {"tokens": [
    {"token": A, "tenant": "a", "role": "scheduler"},
    {"token": A2, "tenant": "a", "role": "scheduler"},  # a second token of the same tenant
    {"token": B, "tenant": "b", "role": "scheduler"},
    {"token": EMPTY, "tenant": "c", "role": "scheduler"},  # a tenant that never creates anything
    {"token": QUOTA, "tenant": "q", "role": "scheduler", "quota_blocks": 3},
    {"token": SEQUENCES, "tenant": "s", "role": "scheduler", "quota_sequences": 2},
    {"token": ADMIN, "tenant": "", "role": "admin"},
]}
PROMPT = list(range(100, 109))  # 9 tokens: two full blocks of 4 and one more


@pytest.fixture(scope="module")
def pki():
    ca = CA.create()
    return dict(ca=ca.cert, server=ca.issue("manager"))


@pytest.fixture
def tenants(pki):
    """(clients by token name, service) of a TLS + token server; invariants checked at the end."""
    config = ManagerConfig(block_size=4, num_gpu_blocks=32, num_cpu_blocks=16, watermark=0.0)
    named = {"a": A, "a2": A2, "b": B, "c": EMPTY, "q": QUOTA, "s": SEQUENCES, "admin": ADMIN}
    with tenant_clients(config, TOKENS, pki["server"], pki["ca"], named) as served:
        yield served


def error_of(call) -> tuple[str, str]:
    with pytest.raises(errors.ManagerError) as info:
        call()
    return info.value.code, str(info.value)


def step_error(client, op) -> tuple[str, str]:
    result = client.step([op]).results[0]
    err = C.result_error(result)
    assert err is not None
    return err.code, str(err)


def batch_error(client, seq_ids) -> list[tuple[str, str]]:
    result = client.step([C.append_batch_op(seq_ids, [1] * len(seq_ids))]).results[0]
    return [(e.code, str(e)) for _, e in C.batch_failures(result)]


def test_another_tenants_sequences_answer_exactly_as_missing_ones(tenants):
    clients, service = tenants
    a, b, c = clients["a"], clients["b"], clients["c"]
    a.allocate("s", num_tokens=6)
    a.allocate("w", num_tokens=5)
    a.swap_out(["w"])
    before = served_fingerprint(service)
    calls = {
        "Append": lambda k: k.append("s", num_tokens=1),
        "Fork": lambda k: k.fork("s", "child"),
        "Free": lambda k: k.free("s"),
        "SwapOut": lambda k: k.swap_out(["s"]),
        "SwapIn": lambda k: k.swap_in(["w"]),
        "GetBlockTable": lambda k: k.get_block_table("s"),
        "GetBlockTable of the swapped one": lambda k: k.get_block_table("w"),
    }
    for name, call in calls.items():
        seen, missing = error_of(lambda: call(b)), error_of(lambda: call(c))
        assert seen[0] == "NOT_FOUND", (name, seen)
        assert seen == missing, name  # b learns nothing c (who never saw anything) would not
        assert "\\x00" not in seen[1] and "'a'" not in seen[1], seen
    step_ops = [C.append_op("s", num_tokens=1), C.fork_op("s", "child"), C.free_op("s"), C.swap_out_op(["s"]),
                C.swap_in_op(["w"])]
    for op in step_ops:
        seen, missing = step_error(b, op), step_error(c, op)
        assert seen[0] == "NOT_FOUND" and seen == missing, (op, seen, missing)
    assert batch_error(b, ["s"]) == batch_error(c, ["s"]) and batch_error(b, ["s"])[0][0] == "NOT_FOUND"
    assert served_fingerprint(service) == before  # nothing of a's (nor anything else) changed
    # All or nothing: the whole step aborted the same way.
    for k in (b, c):
        k.allocate("own", num_tokens=2)
    before = served_fingerprint(service)
    answers = [k.step([C.append_op("own", num_tokens=1), C.append_op("s", num_tokens=1)], all_or_nothing=True)
               for k in (b, c)]
    assert [(r.code, r.message) for r in answers[0].results] == [(r.code, r.message) for r in answers[1].results]
    assert not answers[0].applied
    assert served_fingerprint(service) == before
    # a's second token reads a's tables and reaches a's sequences.
    assert [clients["a2"].get_block_table(seq) for seq in ("s", "w")] == [a.get_block_table(seq) for seq in ("s", "w")]
    clients["a2"].append("s", num_tokens=1)
    assert a.get_block_table("s").num_tokens == 7


def test_the_same_ids_in_two_tenants_are_two_sequences_and_two_requests(tenants):
    clients, service = tenants
    a, b = clients["a"], clients["b"]
    ra = a.allocate("x", num_tokens=4, request_id="r1")
    rb = b.allocate("x", num_tokens=8, request_id="r1")
    assert ra.seq_id == rb.seq_id == "x" and len(ra.block_ids) == 1 and len(rb.block_ids) == 2
    assert set(ra.block_ids).isdisjoint(rb.block_ids)
    # Each tenant's retry gets its own first answer back; nothing applied twice.
    assert a.allocate("x", num_tokens=4, request_id="r1") == ra
    assert b.allocate("x", num_tokens=8, request_id="r1") == rb
    code, message = error_of(lambda: b.allocate("y", num_tokens=4, request_id="r1"))
    assert code == "INVALID_ARGUMENT" and "'r1'" in message and "\\x00" not in message
    assert error_of(lambda: a.allocate("x", num_tokens=4)) == ("ALREADY_EXISTS", "sequence 'x' already exists")
    # Forks, frees and Step answers show the tenant's own ids.
    step = b.step([C.fork_op("x", "x2"), C.append_batch_op(["x", "x2", "gone"], [1, 2, 3])])
    assert sorted(step.batch.seq_ids) == ["x", "x2"] and step.results[0].fork.child_seq_id == "x2"
    assert list(step.results[1].append_batch.failed_messages) == ["no sequence 'gone'"]
    assert a.get_block_table("x").num_tokens == 4 and b.get_block_table("x").num_tokens == 9
    assert a.free("x").seq_id == "x"
    assert error_of(lambda: a.get_block_table("x2"))[0] == "NOT_FOUND"
    assert b.free("x2").seq_id == "x2"
    # Ids are limited by what the client gave (the tenant prefix does not count).
    limit = service.config.max_id_len
    b.allocate("y" * limit, num_tokens=1)
    assert error_of(lambda: b.allocate("z" * (limit + 1), num_tokens=1)) == \
        error_of(lambda: clients["admin"].allocate("z" * (limit + 1), num_tokens=1))
    assert error_of(lambda: b.append("q" * 300, num_tokens=1)) == error_of(lambda: clients["c"].append("q" * 300, num_tokens=1))


def test_the_prefix_cache_is_not_shared_across_tenants(tenants):
    clients, service = tenants
    a, b, admin = clients["a"], clients["b"], clients["admin"]
    assert a.allocate("p1", PROMPT).num_cached_tokens == 0
    assert a.allocate("p2", PROMPT).num_cached_tokens == 8  # same tenant: hit
    assert clients["a2"].allocate("p3", PROMPT).num_cached_tokens == 8  # the tenant's other token too
    assert b.allocate("p1", PROMPT).num_cached_tokens == 0  # another tenant: no hit
    assert b.allocate("p2", PROMPT, namespace="a").num_cached_tokens == 0  # naming a's tenant reaches nothing
    assert admin.allocate("p1", PROMPT, namespace="\0a\0").num_cached_tokens == 0  # nor a crafted namespace
    assert a.allocate("p4", PROMPT, namespace="sub").num_cached_tokens == 0  # a sub-namespace is its own
    assert a.allocate("p5", PROMPT, namespace="sub").num_cached_tokens == 8
    assert b.allocate("p3", PROMPT).num_cached_tokens == 8  # b's own entries hit for b
    # After a frees everything, its blocks stay cached but still serve only a.
    for seq in ("p1", "p2", "p3", "p4", "p5"):
        a.free(seq)
    assert b.allocate("p4", PROMPT).num_cached_tokens == 8
    assert clients["c"].allocate("p1", PROMPT).num_cached_tokens == 0
    assert a.allocate("p6", PROMPT).num_cached_tokens == 8


def test_stats_show_a_scheduler_its_tenant_and_an_admin_every_tenant(tenants):
    clients, service = tenants
    a, b, c, admin = clients["a"], clients["b"], clients["c"], clients["admin"]
    a.allocate("s1", num_tokens=8)          # 2 blocks
    a.fork("s1", "s2")                      # shares them
    a.allocate("s3", num_tokens=3)          # 1 block
    b.allocate("s1", num_tokens=12)         # 3 blocks
    b.swap_out(["s1"])
    stats_a, stats_b, stats_c, stats_admin = (k.get_stats() for k in (a, b, c, admin))
    assert (stats_a.running_sequences, stats_a.swapped_sequences) == (3, 0)
    assert (stats_a.tenant.tenant, stats_a.tenant.gpu_blocks, stats_a.tenant.cpu_blocks) == ("a", 3, 0)
    assert (stats_b.running_sequences, stats_b.swapped_sequences) == (0, 1)
    assert (stats_b.tenant.gpu_blocks, stats_b.tenant.cpu_blocks) == (0, 3)
    assert (stats_c.running_sequences, stats_c.swapped_sequences, stats_c.tenant.gpu_blocks) == (0, 0, 0)
    for s in (stats_a, stats_b, stats_c):
        assert not s.tenants  # no other tenant is listed
        assert s.gpu.used_blocks == 3 and s.cpu.used_blocks == 3  # the pool totals stay visible
    assert (stats_admin.running_sequences, stats_admin.swapped_sequences) == (3, 1)
    by_tenant = {t.tenant: t for t in stats_admin.tenants}
    assert set(by_tenant) == {"a", "b", "q", "s"}  # q, s: no sequences, but a quota of blocks, of sequences
    assert (by_tenant["a"].gpu_blocks, by_tenant["b"].cpu_blocks, by_tenant["a"].running_sequences) == (3, 3, 3)
    assert by_tenant["q"].has_quota and by_tenant["q"].quota_blocks == 3 and not by_tenant["a"].has_quota
    quotas = {name: (t.has_quota, t.quota_blocks, t.has_sequence_quota, t.quota_sequences) for name, t in by_tenant.items()}
    assert quotas == {"a": (False, 0, False, 0), "b": (False, 0, False, 0), "q": (True, 3, False, 0),
                      "s": (False, 0, True, 2)}


def test_stats_show_a_scheduler_its_sequence_quota(tenants):
    clients, _ = tenants
    clients["s"].allocate("s1", num_tokens=4)
    mine = clients["s"].get_stats().tenant
    assert (mine.tenant, mine.running_sequences, mine.has_sequence_quota, mine.quota_sequences) == ("s", 1, True, 2)
    assert not mine.has_quota
    other = clients["q"].get_stats().tenant
    assert (other.has_quota, other.has_sequence_quota, other.quota_sequences) == (True, False, 0)


def test_block_quota_refuses_what_would_go_over_it_nothing_applied(tenants):
    clients, service = tenants
    q = clients["q"]
    q.allocate("s1", num_tokens=8)  # 2 of 3 GPU blocks
    code, message = error_of(lambda: q.allocate("s2", num_tokens=8))
    assert code == "RESOURCE_EXHAUSTED" and "quota of 3" in message and "quota_blocks" in message
    assert "'s2'" in message and "\\x00" not in message
    assert error_of(lambda: q.get_block_table("s2"))[0] == "NOT_FOUND"  # nothing applied
    assert q.get_stats().tenant.gpu_blocks == 2
    # In a Step, only the operation over the quota is refused.
    step = q.step([C.allocate_op("s2", num_tokens=4), C.allocate_op("s3", num_tokens=1)])
    assert step.applied and step.results[0].code == 0 and list(step.batch.seq_ids) == ["s2"]
    assert C.result_error(step.results[1]).code == "RESOURCE_EXHAUSTED"
    assert error_of(lambda: q.append("s2", num_tokens=1))[0] == "RESOURCE_EXHAUSTED"  # a 4th block
    q.fork("s1", "f1")  # sharing takes no block
    assert error_of(lambda: q.append("f1", num_tokens=1))[0] == "RESOURCE_EXHAUSTED"  # a new block for f1
    failures = C.batch_failures(q.step([C.append_batch_op(["s1", "f1"], [1, 2])]).results[0])
    assert [(i, e.code) for i, e in failures] == [(0, "RESOURCE_EXHAUSTED"), (1, "RESOURCE_EXHAUSTED")]
    # Swapped-out blocks do not count; swapping back in must fit again.
    q.swap_out(["s2"])
    q.allocate("s3", num_tokens=1)
    assert error_of(lambda: q.swap_in(["s2"]))[0] == "RESOURCE_EXHAUSTED"
    q.free("s3")
    q.swap_in(["s2"])
    stats = q.get_stats()
    assert (stats.tenant.gpu_blocks, stats.tenant.quota_blocks, stats.tenant.has_quota) == (3, 3, True)
    # Other tenants are not limited by q's quota.
    clients["b"].allocate("big", num_tokens=40)


def test_a_scheduler_counts_only_its_own_lost_sequences(tenants):
    clients, service = tenants
    clients["a"].allocate("s1", num_tokens=4)
    clients["a"].allocate("s2", num_tokens=4)
    clients["b"].allocate("s1", num_tokens=4)
    with service.lock:
        service.manager.lose_all(1)   # as when a replaced worker group took every sequence's K/V
    lost = {name: clients[name].get_stats().lost_sequences for name in ("a", "b", "c", "admin")}
    assert lost == {"a": 2, "b": 1, "c": 0, "admin": 3}
    for name, seq in (("a", "s1"), ("a", "s2"), ("b", "s1")):
        clients[name].free(seq)


def test_blocks_freed_earlier_in_a_step_count_against_the_quota_when_a_prefix_revives_them(tenants):
    # Freed in a Step, a sequence's blocks are HELD until the step ends; a prompt that shares their
    # prefix revives them, and they count against the quota as new blocks do.
    clients, _ = tenants
    q = clients["q"]
    prompt = list(range(200, 212))  # 3 full blocks: the whole quota
    q.allocate("s1", token_ids=prompt)
    step = q.step([C.free_op("s1"), C.allocate_op("s2", token_ids=prompt + [7, 7, 7, 7])])  # 3 revived + 1 new
    assert step.results[0].code == 0
    code, message = C.result_error(step.results[1]).code, str(C.result_error(step.results[1]))
    assert code == "RESOURCE_EXHAUSTED" and "needs 4 more GPU blocks" in message and "quota of 3" in message
    assert q.get_stats().tenant.gpu_blocks == 0
    # Within the quota the revival is welcome: the same prompt again shares every full block but the last.
    q.allocate("s3", token_ids=prompt)
    step = q.step([C.free_op("s3"), C.allocate_op("s4", token_ids=prompt)])
    assert [r.code for r in step.results] == [0, 0]
    assert q.get_stats().tenant.gpu_blocks == 3


def test_without_tokens_every_caller_is_one_tenant_as_before():
    from tests.conftest import running_server

    config = ManagerConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=8, watermark=0.0)
    with running_server(config) as (client, service):
        client.allocate("\0x", num_tokens=4)  # an id that looks like a tenant key is just an id
        assert client.get_block_table("\0x").seq_id == "\0x"
        assert client.step([C.append_op("\0x", num_tokens=1)]).batch.seq_ids == ["\0x"]
        stats = client.get_stats()
        assert stats.running_sequences == 1 and not stats.HasField("tenant") and not stats.tenants
        assert error_of(lambda: client.free("x"))[1] == "no sequence 'x'"


def test_tenant_keys_and_token_quotas():
    for tenant in ("", "a", "long tenant name"):
        for name in ("x", "\0", "\0\0y", "a\0b"):
            assert tenancy.unqualify(tenancy.qualify(tenant, name)) == (tenant, name)
    keys = {tenancy.qualify(t, n) for t in ("", "a", "b") for n in ("x", "\0a\0x", "\0x", "a\0x")}
    assert len(keys) == 12  # one to one
    assert tenancy.qualify("a", "") == "" and tenancy.qualify_namespace("a", "") != tenancy.qualify_namespace("", "")
    table = auth.TokenTable.from_json(TOKENS)
    assert table.quotas() == {"q": 3}
    with pytest.raises(auth.CredentialError, match="NUL"):
        auth.TokenTable.from_json({"tokens": [{"token": A, "tenant": "a\0b", "role": "scheduler"}]})
    with pytest.raises(auth.CredentialError, match="quota_blocks"):
        auth.TokenTable.from_json({"tokens": [{"token": A, "tenant": "a", "role": "scheduler", "quota_blocks": -1}]})
    with pytest.raises(auth.CredentialError, match="two different"):
        auth.TokenTable.from_json({"tokens": [{"token": A, "tenant": "a", "role": "scheduler", "quota_blocks": 1},
                                              {"token": B, "tenant": "a", "role": "scheduler", "quota_blocks": 2}]})


def test_a_step_under_a_block_quota_visits_no_sequence_it_does_not_name(tenants, monkeypatch):
    # The quota check once recounted the tenant's blocks over every live sequence (``tenancy.usage``)
    # on each Step: 130 to 190 ms with 100,000 live. Now it reads the GPU pool's count per tenant.
    clients, service = tenants
    for i in range(8):  # others' sequences, which a Step of q has no business visiting
        clients["a"].allocate(f"x{i}", num_tokens=1)
    q = clients["q"]
    q.allocate("s1", num_tokens=5)  # 2 of its 3 blocks
    q.fork("s1", "f1")   # shares both: still 2
    table = service.manager.seqs
    visits: list[int] = []
    every = table.values
    monkeypatch.setattr(table, "values", lambda: visits.append(len(table)) or every())
    step = q.step([C.append_op("s1", num_tokens=3),    # a copy of the shared last block: 3
                   C.append_op("f1", num_tokens=4)])   # f1's last block is its own now: a 4th, refused
    assert visits == []
    assert step.results[0].code == 0
    assert C.result_error(step.results[1]).code == "RESOURCE_EXHAUSTED"
    assert "holds 3 of its quota of 3" in str(C.result_error(step.results[1]))
    monkeypatch.undo()
    assert q.get_stats().tenant.gpu_blocks == 3
