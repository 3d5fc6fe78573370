"""Security (docs/security.md): TLS, mutual TLS, bearer tokens and roles on real servers on
127.0.0.1 with real certificates made here: missing and wrong credentials, roles calling what
they may not, plaintext against TLS, raw ExecutePlan on a worker and fake worker registrations
are refused; a worker registered with a secured manager executes the manager's plans; the CLI
refuses to start without credentials or --insecure."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys

import grpc
import pytest

from kvpager import auth, errors
from kvpager import client as C
from kvpager.manager import ManagerConfig
from kvpager.manager.service import create_server
from kvpager.v1 import block_manager_pb2 as pb
from kvpager.v1 import block_manager_pb2_grpc as pb_grpc
from kvpager.v1 import plan_pb2, worker_pb2, worker_pb2_grpc
from tests.support.tls import CA, write

SCHEDULER = "scheduler-token-0123456789abcdef"
WORKER = "worker-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"
HASHED = "hashed-scheduler-token-0123456789"
MANAGER_TO_WORKERS = "manager-to-workers-0123456789abcdef"
TOKENS = {"tokens": [
    {"token": SCHEDULER, "tenant": "a", "role": "scheduler"},
    {"token": WORKER, "tenant": "", "role": "worker"},
    {"token": ADMIN, "tenant": "", "role": "admin"},
    {"sha256": hashlib.sha256(HASHED.encode()).hexdigest(), "tenant": "b", "role": "scheduler"},
]}
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("KVPAGER_")}, "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def pki():
    ca = CA.create()
    return dict(ca=ca.cert, server=ca.issue("manager"), client=ca.issue("client", server=False),
                worker=ca.issue("worker"), other_ca=CA.create("another CA"))


@contextlib.contextmanager
def manager(config: ManagerConfig | None = None, **security):
    config = config or ManagerConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=8, watermark=0.0)
    server, port, service, _ = create_server(config, "127.0.0.1:0", **security)
    server.start()
    try:
        yield f"127.0.0.1:{port}", service
    finally:
        server.stop(None)
        service.close()


def code_of(call) -> str:
    with pytest.raises(errors.ManagerError) as info:
        call()
    return info.value.code


def register_request(**fields) -> pb.RegisterWorkerRequest:
    defaults = dict(address="127.0.0.1:1", rank=0, tensor_parallel_size=1, num_gpu_blocks=64, num_cpu_blocks=8,
                    block_size=4)
    return pb.RegisterWorkerRequest(**{**defaults, **fields})


def raw_register(target: str, token: str | None, **fields):
    with auth.channel(target, token=token) as channel:
        return pb_grpc.BlockManagerStub(channel).RegisterWorker(register_request(**fields), timeout=5)


def test_tokens_and_roles():
    with manager(tokens=auth.TokenTable.from_json(TOKENS)) as (target, service):
        with C.BlockManagerClient(target, timeout=5) as anonymous:
            assert code_of(anonymous.ping) == "UNAUTHENTICATED"
            assert code_of(lambda: anonymous.allocate("x", num_tokens=4)) == "UNAUTHENTICATED"
            assert anonymous.health() == "SERVING"  # health stays open
        with C.BlockManagerClient(target, timeout=5, token="not-a-known-token-at-all") as stranger:
            assert code_of(stranger.get_stats) == "UNAUTHENTICATED"
        with C.BlockManagerClient(target, timeout=5, token=SCHEDULER) as scheduler:
            scheduler.ping()
            assert list(scheduler.allocate("s1", num_tokens=6).block_ids)
            scheduler.step([C.fork_op("s1", "s2"), C.append_op("s2", num_tokens=1)])
            assert scheduler.get_stats().running_sequences == 2
        with C.BlockManagerClient(target, timeout=5, token=HASHED) as hashed:  # a "sha256" entry
            hashed.ping()
        with C.BlockManagerClient(target, timeout=5, token=WORKER) as worker:
            assert code_of(lambda: worker.allocate("w", num_tokens=4)) == "PERMISSION_DENIED"
            assert code_of(worker.get_stats) == "PERMISSION_DENIED"
            heartbeat = worker.stub.Heartbeat(pb.HeartbeatRequest(worker_id="nobody"), timeout=5)
            assert not heartbeat.registered  # allowed, just unknown
        with C.BlockManagerClient(target, timeout=5, token=ADMIN) as admin:
            # Sequences are their tenant's: the admin (tenant "") does not reach tenant a's, but sees them in stats.
            assert code_of(lambda: admin.free("s2")) == "NOT_FOUND"
            assert admin.get_stats().running_sequences == 2
        with C.BlockManagerClient(target, timeout=5, token=SCHEDULER) as scheduler:
            scheduler.free("s2")
        with C.BlockManagerClient(target, timeout=5, token=ADMIN) as admin:
            assert admin.get_stats().running_sequences == 1
        # A fake worker: refused without a token and with a scheduler's; no worker is recorded.
        for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED), (SCHEDULER, grpc.StatusCode.PERMISSION_DENIED)):
            with pytest.raises(grpc.RpcError) as info:
                raw_register(target, token, tensor_parallel_size=64)
            assert info.value.code() == code
            assert "RegisterWorker" in info.value.details() or code == grpc.StatusCode.UNAUTHENTICATED
        assert service.registry.workers() == [] and not service.registry.expected
        # An admin passes the check (then the registration itself is judged: block size differs).
        with pytest.raises(grpc.RpcError) as info:
            raw_register(target, ADMIN, block_size=8)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # Denied calls are counted by status like any other.
        text = _metrics_text(service)
        assert 'code="UNAUTHENTICATED"' in text and 'code="PERMISSION_DENIED"' in text


def _metrics_text(service) -> str:
    from prometheus_client import generate_latest

    return generate_latest(service.metrics.registry).decode()


def test_token_table_files_are_checked(tmp_path):
    table = auth.TokenTable.load(write(tmp_path, t=json.dumps(TOKENS))["t"])
    assert len(table) == 4 and table.lookup(SCHEDULER) == auth.Identity("a", "scheduler")
    assert table.lookup(HASHED) == auth.Identity("b", "scheduler") and table.lookup("x" * 20) is None
    for bad, fragment in [({"tokens": []}, "expected"), ({"tokens": [{"token": SCHEDULER, "role": "root"}]}, "role"),
                          ({"tokens": [{"token": "short", "role": "admin"}]}, "16 characters"),
                          ({"tokens": [{"sha256": "ab", "role": "admin"}]}, "64 hex"),
                          ({"tokens": [{"token": SCHEDULER, "sha256": "ab" * 32, "role": "admin"}]}, "exactly one"),
                          ({"tokens": [{"token": SCHEDULER, "role": "admin"}, {"token": SCHEDULER, "role": "worker"}]},
                           "twice")]:
        with pytest.raises(auth.CredentialError, match=fragment):
            auth.TokenTable.from_json(bad)
    assert auth.bearer_token([("authorization", "Bearer abc")]) == "abc"
    assert auth.bearer_token([("authorization", "Basic abc")]) is None and auth.bearer_token(None) is None


def test_tls_refuses_plaintext_and_serves_tls_clients(pki):
    tls = auth.TLS(cert=pki["server"].cert, key=pki["server"].key)
    with manager(tls=tls) as (target, _):
        with C.BlockManagerClient(target, timeout=3) as plaintext:
            assert code_of(plaintext.ping) == "UNAVAILABLE"
        with C.BlockManagerClient(target, timeout=3, root_certificates=pki["other_ca"].cert) as wrong_ca:
            assert code_of(wrong_ca.ping) == "UNAVAILABLE"
        with C.BlockManagerClient(target, timeout=5, root_certificates=pki["ca"]) as secure:
            secure.ping()
            assert secure.health() == "SERVING"
        from kvpager import healthcheck  # what container health checks run

        assert healthcheck.check(target, ca=pki["ca"]) is None
        assert "UNAVAILABLE" in healthcheck.check(target, timeout=2)


def test_mutual_tls_refuses_a_client_without_a_certificate(pki, tmp_path):
    tls = auth.TLS(cert=pki["server"].cert, key=pki["server"].key, client_ca=pki["ca"])
    files = write(tmp_path, ca=pki["ca"], cert=pki["client"].cert, key=pki["client"].key)
    with manager(tls=tls, tokens=auth.TokenTable.from_json(TOKENS)) as (target, _):
        with C.BlockManagerClient(target, timeout=3, root_certificates=pki["ca"], token=SCHEDULER) as no_cert:
            assert code_of(no_cert.ping) == "UNAVAILABLE"
        with C.BlockManagerClient(target, timeout=5, root_certificates=files["ca"], certificate_chain=files["cert"],
                                  private_key=files["key"], token=SCHEDULER) as client:  # paths work too
            client.ping()
        with C.BlockManagerClient(target, timeout=5, root_certificates=pki["ca"], certificate_chain=pki["client"].cert,
                                  private_key=pki["client"].key) as no_token:  # a certificate is not a token
            assert code_of(no_token.ping) == "UNAUTHENTICATED"


def test_a_worker_serves_only_the_secured_manager(pki):
    torch = pytest.importorskip("torch")
    from kvpager.worker.cache_worker import CacheWorker, WorkerConfig
    from kvpager.worker.model import ModelConfig

    model = ModelConfig(num_layers=2, hidden_size=64, num_q_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=128, seed=3)
    config = ManagerConfig(block_size=4, num_gpu_blocks=0, num_cpu_blocks=0, watermark=0.0)
    manager_tls = auth.TLS(cert=pki["server"].cert, key=pki["server"].key, client_ca=pki["ca"])
    to_workers = auth.TLS(cert=pki["server"].cert, key=pki["server"].key, ca=pki["ca"])
    with manager(config, tokens=auth.TokenTable.from_json(TOKENS), tls=manager_tls, worker_tls=to_workers,
                 worker_token=MANAGER_TO_WORKERS) as (target, service):
        creds = auth.WorkerCredentials(
            tls=auth.TLS(cert=pki["worker"].cert, key=pki["worker"].key, client_ca=pki["ca"], ca=pki["ca"]),
            auth_token=WORKER, manager_token=MANAGER_TO_WORKERS)
        assert "token" not in repr(creds).replace("_token", "") and WORKER not in repr(creds)
        worker = CacheWorker(WorkerConfig(model=model, block_size=4, num_gpu_blocks=16, num_cpu_blocks=8,
                                          manager_address=target, device="cpu", credentials=creds))
        worker.start()
        try:
            assert worker.worker_config().credentials is None  # attachers never get the secrets
            with C.BlockManagerClient(target, timeout=10, token=SCHEDULER, root_certificates=pki["ca"],
                                      certificate_chain=pki["client"].cert, private_key=pki["client"].key) as sched:
                assert sched.get_stats().workers_registered == 1
                sched.allocate("p", token_ids=list(range(6)))  # 2 blocks, the last one partly filled
                reply = sched.step([C.fork_op("p", "c"), C.append_op("c", token_ids=[7])])
                assert all(r.code == 0 for r in reply.results)
                assert len(reply.plan.blocks_to_copy.src) == 1  # copy-on-write, executed by the worker
            assert worker.memory_stats().blocks_copied == 1
            before = worker.cache.blocks.clone()
            plan = plan_pb2.ExecutionPlan(step_id=99, blocks_to_copy=plan_pb2.BlockMapping(src=[0], dst=[1]))
            request = worker_pb2.ExecutePlanRequest(plan=plan)
            attempts = [  # (channel, expected status)
                (auth.raw_channel(worker.address), grpc.StatusCode.UNAVAILABLE),  # plaintext
                (auth.raw_channel(worker.address, pki["ca"]), grpc.StatusCode.UNAVAILABLE),  # no client cert
                (auth.raw_channel(worker.address, pki["ca"], pki["client"].cert, pki["client"].key),
                 grpc.StatusCode.UNAUTHENTICATED),  # a certificate but not the manager's token
                (auth.channel(worker.address, auth.TLS(cert=pki["client"].cert, key=pki["client"].key, ca=pki["ca"]),
                              SCHEDULER), grpc.StatusCode.UNAUTHENTICATED),  # a manager token is not the manager's
            ]
            for channel, code in attempts:
                with channel:
                    with pytest.raises(grpc.RpcError) as info:
                        worker_pb2_grpc.CacheWorkerStub(channel).ExecutePlan(request, timeout=3)
                    assert info.value.code() == code, info.value.details()
            assert worker.memory_stats().plans_executed == 1 and torch.equal(worker.cache.blocks, before)
            # Health stays open to a TLS client with a certificate.
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            with auth.raw_channel(worker.address, pki["ca"], pki["client"].cert, pki["client"].key) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            worker.stop()


def kvpager(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpager", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def test_the_cli_refuses_to_run_without_credentials_or_insecure():
    for argv, fragment in ((["manager", "--port", "0"], "--auth-tokens FILE"),
                           (["worker", "--manager", "127.0.0.1:1"], "--auth-token FILE")):
        proc = kvpager(*argv)
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "no credentials" in lines[0] and fragment in lines[0] and "--insecure" in lines[0]


def test_made_up_methods_add_no_metric_series():
    """An anonymous caller's made-up method names (answered UNAUTHENTICATED like real ones) are
    counted under method="unknown": they cannot grow the RPC metrics without bound."""
    from prometheus_client import generate_latest

    with manager(tokens=auth.TokenTable.single(ADMIN, "admin")) as (target, service):
        with grpc.insecure_channel(target) as channel:
            for i in range(20):
                call = channel.unary_unary(f"/made.up/Method{i}", request_serializer=lambda b: b,
                                           response_deserializer=lambda b: b)
                with pytest.raises(grpc.RpcError) as denied:
                    call(b"", timeout=5)
                assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        text = generate_latest(service.metrics.registry).decode()
    assert "Method1" not in text
    assert 'kvpager_rpc_requests_total{code="UNAUTHENTICATED",method="unknown"} 20.0' in text, \
        [line for line in text.splitlines() if line.startswith("kvpager_rpc_requests_total")]


def test_tls_material_that_does_not_load_is_refused_at_start_in_one_line(pki, tmp_path):
    server, worker = pki["server"], pki["worker"]
    bad = {"another certificate's key": auth.TLS(cert=server.cert, key=worker.key),
           "a certificate that is not PEM": auth.TLS(cert=b"not a certificate", key=server.key),
           "a client CA that is not PEM": auth.TLS(cert=server.cert, key=server.key, client_ca=b"not a CA")}
    for what, tls in bad.items():
        with pytest.raises(auth.CredentialError, match="do not load together|not a PEM certificate"):
            create_server(ManagerConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=8), "127.0.0.1:0", tls=tls)
    with manager(tls=auth.TLS(cert=server.cert, key=server.key, client_ca=pki["ca"])):   # good material serves
        pass
    paths = write(tmp_path, cert=server.cert, key=worker.key)
    proc = kvpager("manager", "--insecure", "--port", "0", "--tls-cert", paths["cert"], "--tls-key", paths["key"])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "do not load together (KEY_VALUES_MISMATCH)" in lines[0]


def test_a_secured_manager_process_and_stats(pki, tmp_path):
    files = write(tmp_path, tokens=json.dumps(TOKENS), cert=pki["server"].cert, key=pki["server"].key, ca=pki["ca"],
                  sched=SCHEDULER + "\n", worker=WORKER)
    proc = subprocess.Popen([sys.executable, "-m", "kvpager", "manager", "--port", "0", "--auth-tokens",
                             files["tokens"], "--tls-cert", files["cert"], "--tls-key", files["key"]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        match = re.search(r"listening on (\S+)", proc.stdout.readline())
        assert match, proc.stderr.read() if proc.poll() is not None else "no listening line"
        target = match.group(1)
        ok = kvpager("stats", "--manager", target, "--once", "--auth-token", files["sched"], "--tls-ca", files["ca"])
        assert ok.returncode == 0 and "kvpager manager" in ok.stdout, ok.stderr
        denied = kvpager("stats", "--manager", target, "--once", "--auth-token", files["worker"], "--tls-ca", files["ca"])
        assert denied.returncode == 1 and "refused the call: PERMISSION_DENIED" in denied.stderr, denied.stderr
        missing = kvpager("stats", "--manager", target, "--once", "--tls-ca", files["ca"])
        assert missing.returncode == 1 and "refused the call: UNAUTHENTICATED" in missing.stderr, missing.stderr
        plain = kvpager("stats", "--manager", target, "--once", "--auth-token", files["sched"])
        assert plain.returncode == 1 and "cannot reach the block manager" in plain.stderr
    finally:
        proc.terminate()
        proc.wait(20)
    assert "WITHOUT authentication" not in proc.stderr.read()


def test_worker_flags_become_credentials_for_the_ranks(pki, tmp_path):
    import pickle

    from kvpager.commands import cli
    from kvpager.commands import worker as launcher

    files = write(tmp_path, ca=pki["ca"], cert=pki["worker"].cert, key=pki["worker"].key, worker=f" {WORKER}\n",
                  mgr=MANAGER_TO_WORKERS, empty="", accented="tok\u00e9n\n")

    def parse(*argv):
        parser, parsers = cli.build_parser(["worker"])
        return parser.parse_args(["worker", "--manager", "127.0.0.1:1", *argv])

    creds = launcher.credentials(parse("--auth-token", files["worker"], "--manager-token", files["mgr"],
                                       "--tls-cert", files["cert"], "--tls-key", files["key"], "--tls-ca", files["ca"]))
    assert (creds.auth_token, creds.manager_token) == (WORKER, MANAGER_TO_WORKERS)
    assert creds.tls == auth.TLS(cert=pki["worker"].cert, key=pki["worker"].key, ca=pki["ca"])
    assert pickle.loads(pickle.dumps(creds)) == creds  # what Ray ships to the actors
    assert launcher.credentials(parse("--insecure")) is None
    for argv, fragment in ((["--auth-token", files["worker"]], "no credentials"),  # nothing guards the service
                           (["--insecure", "--auth-token", files["empty"]], "is empty"),
                           (["--insecure", "--auth-token", files["accented"]], "index 3 is not printable ASCII"),
                           (["--insecure", "--tls-cert", files["cert"]], "--tls-key"),
                           (["--insecure", "--auth-token", str(tmp_path / "missing")], "cannot read")):
        with pytest.raises(cli.Failure, match=fragment):
            launcher.credentials(parse(*argv))
