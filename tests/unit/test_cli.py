"""The `kvpager` command line: complete help, environment defaults, one-line errors and exit codes,
and the stats view. Fast: nothing here starts Ray or a model (the real processes are in
tests/integration/test_cli.py)."""

from __future__ import annotations

import io
import logging
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from kvpager.commands import bench, cli, progress, stats_view
from kvpager.client import BlockManagerClient
from kvpager.manager import ManagerConfig
from kvpager.manager.service import create_server
from kvpager.v1 import block_manager_pb2 as pb

SUBCOMMANDS = ["manager", "worker", "generate", "demo", "stats", "bench"]


def kvpager(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m kvpager ARGS`` in a child process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "kvpager", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def pool_total_is(total: int, configured: int) -> bool:
    """Whether GetStats' GPU total fits a pool of ``configured`` blocks: all of them, or all but
    the null block where the pool reserves one (padding of block tables; manager/block_pool.py)."""
    return total in (configured, configured - 1)


def parse(*argv: str):
    parser, _ = cli.build_parser(argv)
    return parser.parse_args(argv)


def closed_port() -> int:
    """A loopback port nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def assert_one_line_error(proc: subprocess.CompletedProcess, code: int, *fragments: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("kvpager"), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # help lines unwrapped, so each flag's text is on one line
    for name in [n for n in os.environ if n.startswith("KVPAGER_")]:
        monkeypatch.delenv(name)


# ---- help ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_help_of_each_subcommand_names_every_flag_with_its_env_var_and_default(command, capsys):
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvpager {command}")
    _, parsers = cli.build_parser([command])
    flags = [a for a in parsers[command]._actions if a.option_strings and "-h" not in a.option_strings]
    assert flags
    text = " ".join(out.split())
    for action in flags:
        assert action.option_strings[0] in out
        assert action.help and " ".join(action.help.replace("%%", "%").split()) in text, action.option_strings
        if command != "bench":
            assert f"[env {action.env}; " in action.help, action.option_strings
            assert "; default " in action.help or "; required]" in action.help, action.option_strings


def test_top_level_help_lists_the_subcommands_and_python_dash_m_works():
    proc = kvpager("--help")
    assert proc.returncode == 0, proc.stderr
    for command in SUBCOMMANDS:
        assert f"    {command} " in proc.stdout
    assert kvpager("--version").stdout.startswith("kvpager ")


def test_console_script_is_installed():
    script = shutil.which("kvpager", path=os.path.dirname(sys.executable))
    assert script, "kvpager console script missing from the environment (pip install -e .)"
    proc = subprocess.run([script, "stats", "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "--interval" in proc.stdout


def test_help_shows_the_value_the_environment_sets(monkeypatch, capsys):
    monkeypatch.setenv("KVPAGER_STATS_INTERVAL", "2.5")
    assert cli.main(["stats", "--help"]) == 0
    assert "[env KVPAGER_STATS_INTERVAL=2.5; default 1.0]" in capsys.readouterr().out


# ---- environment defaults ------------------------------------------------------------------------
def test_environment_feeds_defaults_and_flags_win(monkeypatch):
    monkeypatch.setenv("KVPAGER_MANAGER_ADDRESS", "127.0.0.9:6000")
    monkeypatch.setenv("KVPAGER_STATS_INTERVAL", "2.5")
    monkeypatch.setenv("KVPAGER_STATS_ONCE", "yes")
    args = parse("stats")
    assert (args.manager, args.interval, args.once, args.count) == ("127.0.0.9:6000", 2.5, True, None)
    args = parse("stats", "--interval", "3", "--manager", "127.0.0.8:1")
    assert (args.manager, args.interval) == ("127.0.0.8:1", 3.0)


def test_each_value_says_where_it_came_from(monkeypatch):
    monkeypatch.setenv("KVPAGER_STATS_INTERVAL", "2.5")
    monkeypatch.setenv("KVPAGER_STATS_ONCE", "1")
    args = parse("stats", "--count", "1", "--manager", "127.0.0.8:1")
    where = {dest: cli.source(args, dest) for dest in ("manager", "interval", "once", "count", "tls_ca")}
    assert where == dict(manager=cli.Source.COMMAND_LINE, interval=cli.Source.ENVIRONMENT,
                         once=cli.Source.ENVIRONMENT, count=cli.Source.COMMAND_LINE, tls_ca=cli.Source.DEFAULT)
    # A value typed equal to the default still came from the command line.
    assert cli.source(parse("stats", "--interval", "1.0"), "interval") is cli.Source.COMMAND_LINE
    assert cli.outranks(args, "count", "once") and not cli.outranks(args, "once", "count")


def test_settle_lets_the_typed_side_of_a_clash_win_and_unsets_the_other(monkeypatch):
    monkeypatch.setenv("KVPAGER_TENSOR_PARALLEL_SIZE", "2")
    args = parse("generate", "--model", "m", "--no-ray", "hi")
    assert cli.settle(args, "no_ray", "tensor_parallel_size")
    assert (args.no_ray, args.tensor_parallel_size) == (True, 1)   # the variable's 2 ignored: the default
    assert cli.source(args, "tensor_parallel_size") is cli.Source.DEFAULT
    monkeypatch.setenv("KVPAGER_MANAGER_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("KVPAGER_RAY_ADDRESS", "127.0.0.1:2")
    args = parse("demo", "--model", "m")   # a side of several flags: all of the losing side unset
    assert cli.settle(args, ("manager", "ray_address"), "model")
    assert (args.manager, args.ray_address, args.model) == (None, None, "m")
    both_typed = parse("generate", "--model", "m", "--no-ray", "--tensor-parallel-size", "2", "hi")
    monkeypatch.setenv("KVPAGER_NO_RAY", "1")
    both_from_the_environment = parse("generate", "--model", "m", "hi")
    for args in (both_typed, both_from_the_environment):
        assert not cli.settle(args, "no_ray", "tensor_parallel_size")
        assert (args.no_ray, args.tensor_parallel_size) == (True, 2)   # unchanged: the caller refuses


def test_environment_configures_the_manager(monkeypatch):
    for name, value in dict(KVPAGER_HOST="127.0.0.3", KVPAGER_PORT="6000", KVPAGER_METRICS_PORT="0",
                            KVPAGER_BLOCK_SIZE="32", KVPAGER_ENABLE_PREFIX_CACHING="false").items():
        monkeypatch.setenv(name, value)
    args = parse("manager")
    assert (args.host, args.port, args.metrics_host, args.metrics_port) == ("127.0.0.3", 6000, "127.0.0.1", 0)
    assert (args.block_size, args.enable_prefix_caching, args.num_gpu_blocks) == (32, False, 0)
    assert parse("manager", "--port", "7000").port == 7000
    assert parse("manager").metrics_port == 0 and "KVPAGER_METRICS_PORT" in os.environ
    monkeypatch.delenv("KVPAGER_METRICS_PORT")
    assert parse("manager").metrics_port is None  # unset: no metrics endpoint


def test_environment_configures_the_worker_and_empty_values_count_as_unset(monkeypatch):
    for name, value in dict(KVPAGER_MANAGER_ADDRESS="127.0.0.1:50051", KVPAGER_RAY_ADDRESS="127.0.0.2:6379",
                            KVPAGER_RAY_JOIN="1", KVPAGER_TENSOR_PARALLEL_SIZE="2", KVPAGER_WORKER_DEVICE="cpu",
                            KVPAGER_WORKER_METRICS_PORT="9500", KVPAGER_WORKER_NUM_GPU_BLOCKS="",
                            KVPAGER_MODEL="tiny").items():
        monkeypatch.setenv(name, value)
    args = parse("worker")
    assert (args.manager, args.ray_address, args.join, args.tensor_parallel_size) == (
        "127.0.0.1:50051", "127.0.0.2:6379", True, 2)
    assert (args.device, args.metrics_port, args.num_gpu_blocks, args.model) == ("cpu", 9500, None, "tiny")
    assert (args.namespace, args.host, args.block_size, args.num_cpu_blocks) == ("kvpager", "127.0.0.1", 16, None)


def test_demo_reads_the_deployment_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVPAGER_MANAGER_ADDRESS", "127.0.0.1:50051")
    monkeypatch.setenv("KVPAGER_RAY_ADDRESS", "127.0.0.2:6379")
    args = parse("demo")
    assert (args.manager, args.ray_address, args.namespace, args.requests) == (
        "127.0.0.1:50051", "127.0.0.2:6379", "kvpager", 240)
    monkeypatch.delenv("KVPAGER_MANAGER_ADDRESS")
    assert parse("demo").manager is None  # embedded, as `make demo` runs it


# ---- usage errors: one line, exit 2 --------------------------------------------------------------
@pytest.mark.parametrize("argv, env, fragments", [
    ([], {}, ["kvpager: error:", "COMMAND"]),
    (["frobnicate"], {}, ["invalid choice: 'frobnicate'"]),
    (["stats", "--bogus"], {}, ["kvpager stats: error:", "unrecognized arguments: --bogus", "kvpager stats --help"]),
    (["stats", "--interval", "soon"], {}, ["--interval", "expected a number"]),
    (["stats", "--manager", "localhost"], {}, ["expected HOST:PORT"]),
    (["stats"], {"KVPAGER_STATS_INTERVAL": "soon"}, ["KVPAGER_STATS_INTERVAL='soon'", "--interval"]),
    (["manager", "--port", "70000"], {}, ["kvpager manager: error:", "0..65535"]),
    (["manager", "--watermark", "1.5"], {}, ["--watermark must be in [0, 1)"]),
    (["manager", "--worker-heartbeat-timeout", "nan"], {}, ["--worker-heartbeat-timeout must be > 0 and < 1e+06"]),
    (["manager", "--worker-plan-timeout", "inf"], {}, ["--worker-plan-timeout must be > 0 and < 1e+06"]),
    (["stats", "--interval", "inf"], {}, ["--interval", "must be > 0 and finite"]),
    (["demo", "--metrics-port", "70000"], {}, ["--metrics-port", "0..65535"]),
    (["manager", "--block-size", "0"], {}, ["kvpager manager: error: --block-size must be in [1, 1024]"]),
    (["manager", "--insecure", "--port", "0", "--metrics-token", "/nonexistent"], {},
     ["kvpager manager: error: --metrics-token (or KVPAGER_METRICS_TOKEN) needs --metrics-port"]),
    (["manager", "--insecure", "--port", "0"], {"KVPAGER_METRICS_TOKEN": "/nonexistent"},
     ["--metrics-token (or KVPAGER_METRICS_TOKEN) needs --metrics-port (or KVPAGER_METRICS_PORT)"]),
    (["worker"], {}, ["--manager (or KVPAGER_MANAGER_ADDRESS) is required"]),
    (["worker", "--manager", "127.0.0.1:1", "--device", "tpu"], {}, ["invalid choice: 'tpu'"]),
    (["worker", "--manager", "127.0.0.1:1"], {"KVPAGER_WORKER_DEVICE": "tpu"},
     ["KVPAGER_WORKER_DEVICE", "choose from"]),
    (["worker", "--manager", "127.0.0.1:1", "--join"], {}, ["--join needs --ray-address"]),
    (["worker", "--manager", "127.0.0.1:1", "--memory-fraction", "2"], {}, ["must be in (0, 1]"]),
    (["worker", "--manager", "127.0.0.1:1", "--block-size", "0"], {}, ["kvpager worker: error: argument --block-size"]),
    (["worker", "--manager", "127.0.0.1:1", "--num-cpu-blocks", "-1"], {},
     ["kvpager worker: error: argument --num-cpu-blocks: must be >= 0"]),
    (["demo", "--block-size", "2048"], {}, ["kvpager demo: error: --block-size must be in [1, 1024], got 2048"]),
    (["generate", "--model", "/nonexistent", "--ray", "--no-ray", "hi"], {}, ["--ray and --no-ray: choose one"]),
    (["generate", "--model", "/nonexistent", "--top-k", "-1", "hi"], {}, ["argument --top-k: must be >= 0, got -1"]),
    (["bench"], {}, ["name a benchmark"]),
    (["bench", "nope"], {}, ["invalid choice: 'nope'"]),
])
def test_bad_flags_end_with_one_line_and_exit_2(argv, env, fragments):
    assert_one_line_error(kvpager(*argv, env=env), 2, *fragments)


def test_a_state_dir_that_is_a_file_fails_in_one_line(tmp_path):
    (tmp_path / "state").write_text("not a folder")
    proc = kvpager("manager", "--insecure", "--port", "0", "--state-dir", str(tmp_path / "state"))
    assert_one_line_error(proc, 1, "cannot recover the manager's state", "is not a directory")


def test_worker_metrics_ports_past_65535_fail_in_one_line():
    from kvpager.manager import ManagerConfig
    from kvpager.manager.service import create_server

    server, port, service, _ = create_server(ManagerConfig(num_gpu_blocks=0), "127.0.0.1:0")
    server.start()
    try:
        proc = kvpager("worker", "--insecure", "--manager", f"127.0.0.1:{port}", "--tensor-parallel-size", "2",
                       "--device", "cpu", "--metrics-port", "65535")
    finally:
        server.stop(None)
        service.close()
    assert_one_line_error(proc, 1, "--metrics-port 65535", "rank 1's port 65536 is beyond 65535")


def test_demo_rejects_half_a_deployment():
    assert_one_line_error(kvpager("demo", "--manager", "127.0.0.1:1"), 2, "--manager needs --ray-address")


def test_demo_deployment_or_embedded_flags_typed_win_over_the_environment():
    deployment = {"KVPAGER_MANAGER_ADDRESS": "127.0.0.1:1", "KVPAGER_RAY_ADDRESS": "127.0.0.1:2"}
    # Typed embedded flags win over a deployment from the environment: the demo goes on embedded
    # (to the embedded manager's check of --block-size, exit 2 before anything starts).
    for typed in (["--model", "/nonexistent"], ["--no-ray"]):
        proc = kvpager("demo", *typed, "--block-size", "2048", env=deployment)
        assert_one_line_error(proc, 2, "--block-size must be in [1, 1024], got 2048")
    # A typed deployment wins over the environment's --model or --no-ray: the demo goes on to it.
    manager = f"127.0.0.1:{closed_port()}"
    for env in ({"KVPAGER_MODEL": "/nonexistent"}, {"KVPAGER_DEMO_NO_RAY": "1"}):
        proc = kvpager("demo", "--manager", manager, "--ray-address", "127.0.0.1:2", env=env)
        assert_one_line_error(proc, 1, f"cannot reach the block manager at {manager}")
    # Both typed, or both from the environment: refused.
    proc = kvpager("demo", "--manager", "127.0.0.1:1", "--ray-address", "127.0.0.1:2", "--model", "/nonexistent")
    assert_one_line_error(proc, 2, "--model is for the embedded workers")
    proc = kvpager("demo", env={**deployment, "KVPAGER_DEMO_NO_RAY": "1"})
    assert_one_line_error(proc, 2, "--no-ray runs a worker in this process: not with --manager")


def test_rays_report_of_a_dashboard_nobody_asked_for_stays_off_the_terminal(caplog):
    cli.quiet_ray_startup()
    cli.quiet_ray_startup()   # once is enough: no second filter
    services = logging.getLogger("ray._private.services")
    assert sum(isinstance(f, cli._NoDashboard) for f in services.filters) == 1
    with caplog.at_level(logging.ERROR, logger="ray._private.services"):
        services.error("Failed to start the dashboard , return code -6")
        services.error("Couldn't read dashboard.log file. Error: no such file")
        services.error("Failed to start the raylet")
    assert [r.getMessage() for r in caplog.records] == ["Failed to start the raylet"]


# ---- progress: a bar on a terminal, a few lines elsewhere ---------------------------------------------
class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_off_a_terminal_prints_a_line_per_tenth_of_the_work_or_after_a_quiet_stretch(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    out = _Stream(tty=False)
    bar = progress.Progress(200, "done", every=5.0, stream=out)
    for done in range(1, 201):   # 200 updates, 10 tenths: 10 lines, not 200
        bar.update(done, f"running {done}")
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and "\r" not in out.getvalue()
    assert lines[0].startswith("[###") and "20/200 done  running 20" in lines[0] and lines[-1].startswith("[" + "#" * 30)
    bar.update(200)                  # nothing new, no time passed: no line
    clock[0] += 6                    # a stretch longer than every: a line even within a tenth
    bar.update(200)
    assert len(out.getvalue().splitlines()) == 11 and out.getvalue().endswith("6 s\n")
    bar.close()
    assert len(out.getvalue().splitlines()) == 11


def test_progress_on_a_terminal_redraws_one_line_and_quiet_prints_nothing(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    tty = _Stream(tty=True)
    bar = progress.Progress(3, "checked", stream=tty)
    for done in (1, 2, 3):
        clock[0] += 1
        bar.update(done)
    bar.close()
    assert tty.getvalue().count("\r") == 3 and tty.getvalue().count("\n") == 1 and "3/3 checked" in tty.getvalue()
    silent = _Stream(tty=False)
    quiet = progress.Progress(3, quiet=True, stream=silent)
    quiet.update(3)
    quiet.close()
    assert silent.getvalue() == ""


# ---- failures at run time: one line, exit 1 ------------------------------------------------------
def test_stats_against_an_unreachable_manager_exits_1():
    port = closed_port()
    proc = kvpager("stats", "--manager", f"127.0.0.1:{port}", "--once")
    assert_one_line_error(proc, 1, f"kvpager stats: cannot reach the block manager at 127.0.0.1:{port}: "
                                   "connection refused (nothing listens there")


def test_worker_against_an_unreachable_manager_exits_1_before_starting_ray():
    port = closed_port()
    started = time.monotonic()
    proc = kvpager("worker", "--insecure", "--manager", f"127.0.0.1:{port}", "--device", "cpu")
    assert_one_line_error(proc, 1, f"kvpager worker: cannot reach the block manager at 127.0.0.1:{port}",
                          "connection refused (nothing listens there")
    assert time.monotonic() - started < 30


def test_manager_on_a_port_in_use_exits_1():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = kvpager("manager", "--insecure", "--port", str(port), timeout=30)
    assert_one_line_error(proc, 1, f"kvpager manager: cannot serve on 127.0.0.1:{port}", "in use")


def test_guarded_turns_every_failure_into_one_line(capsys):
    parser = cli.Parser(prog="kvpager test")
    args = parser.parse_args([])

    def raising(exc):
        def run(_args):
            raise exc
        return run

    assert cli.guarded(parser, raising(KeyboardInterrupt()), args) == 130
    assert capsys.readouterr().err == ""  # Ctrl-C: quiet
    assert cli.guarded(parser, raising(cli.Failure("no route\nmore detail")), args) == 1
    assert capsys.readouterr().err == "kvpager test: no route\n"
    assert cli.guarded(parser, raising(ZeroDivisionError("boom")), args) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvpager test: ZeroDivisionError: boom") and err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_:
        cli.guarded(parser, raising(cli.UsageError("flags disagree")), args)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "kvpager test: error: flags disagree (see kvpager test --help)\n"


def test_a_registration_failure_inside_ray_is_reported_by_its_grpc_status():
    from kvpager.commands.worker_refusals import ray_error_cause

    class RayTaskErrorLike(Exception):
        traceback_str = ('Traceback (most recent call last):\n  File "x.py", line 1, in start\n'
                         "grpc._channel._InactiveRpcError: <_InactiveRpcError of RPC that terminated with:\n"
                         "\tstatus = StatusCode.FAILED_PRECONDITION\n"
                         '\tdetails = "register worker: its block size 8 differs from the manager\'s 16"\n>')

    assert ray_error_cause(RayTaskErrorLike()) == ("FAILED_PRECONDITION: register worker: its block size 8 "
                                                   "differs from the manager's 16")

    class OtherError(Exception):
        traceback_str = 'Traceback (most recent call last):\n  File "x.py", line 1\nRuntimeError: no room for a block'

    assert ray_error_cause(OtherError()) == "RuntimeError: no room for a block"


# ---- the worker's defaults and the manager's ----------------------------------------------------------
def test_worker_default_cache_sizes_are_modest_on_the_cpu_and_unchanged_on_cuda(monkeypatch):
    import torch

    from kvpager.worker import cache_sizing

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    free = {"cpu": 20 << 30, "cuda": 80 << 30}
    monkeypatch.setattr(cache_sizing, "free_device_memory", lambda device: free[device.type])
    # The CPU: 256 MiB per rank, not half of 20 GiB of RAM...
    assert cache_sizing.default_device_blocks(cpu, 8192, 0.5, ranks_sharing=1) == (256 << 20) // 8192
    assert cache_sizing.default_device_blocks(cpu, 8192, 0.5, ranks_sharing=2) == (256 << 20) // 8192
    # ...and less where the fraction of the available RAM shared by the ranks is smaller.
    free["cpu"] = 1 << 30
    assert cache_sizing.default_device_blocks(cpu, 8192, 0.5, ranks_sharing=4) == (128 << 20) // 8192
    # CUDA: the fraction of the free GPU memory, as before.
    assert cache_sizing.default_device_blocks(cuda, 1 << 20, 0.5, ranks_sharing=1) == 40 * 1024
    # Swap: the manager's default CPU pool, at most 4 GiB.
    assert cache_sizing.default_swap_blocks(8192) == 4096
    assert cache_sizing.default_swap_blocks(2 << 20) == 2048


def test_worker_defaults_fit_the_managers_default_pools():
    from kvpager.worker import cache_sizing
    from kvpager.worker.kv_cache import CacheSpec
    from kvpager.worker.model import preset

    tiny = preset("tiny")  # the CPU's default model, one rank
    block_bytes = CacheSpec(tiny.num_layers, tiny.num_kv_heads, tiny.head_dim, 16, tiny.cache_dtype).block_bytes
    defaults = ManagerConfig()
    assert cache_sizing.CPU_CACHE_BYTES // block_bytes >= defaults.num_gpu_blocks
    assert cache_sizing.default_swap_blocks(block_bytes) >= defaults.num_cpu_blocks
    assert parse("worker", "--manager", "127.0.0.1:1").block_size == defaults.block_size


@pytest.fixture
def default_manager():
    """A manager with `kvpager manager`'s default configuration, in this process; its address."""
    server, port, service, _ = create_server(ManagerConfig())
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)
    service.close()


def register(target: str, **fields) -> str:
    """RegisterWorker as a worker sends it (defaults: one rank that fits the default pools); its
    refusal's details, or "" when it registered."""
    import grpc

    from kvpager.v1 import block_manager_pb2_grpc as pb_grpc

    request = {**dict(address="127.0.0.1:1", rank=0, tensor_parallel_size=1, num_gpu_blocks=4096,
                      num_cpu_blocks=4096, block_size=16), **fields}
    with grpc.insecure_channel(target) as channel:
        try:
            pb_grpc.BlockManagerStub(channel).RegisterWorker(pb.RegisterWorkerRequest(**request), timeout=10)
        except grpc.RpcError as err:
            assert err.code().name == "FAILED_PRECONDITION", err
            return err.details()
    return ""


def test_a_refused_registration_becomes_one_line_naming_both_values_and_the_flags(default_manager):
    from kvpager.commands.worker_refusals import explain_refusal

    target = default_manager
    line = explain_refusal(f"FAILED_PRECONDITION: {register(target, block_size=32)}", target)
    assert line.startswith("block size mismatch:"), line
    assert "--block-size 16" in line and "--block-size 32" in line and target in line
    line = explain_refusal(f"FAILED_PRECONDITION: {register(target, num_cpu_blocks=256)}", target)
    assert line.startswith("cache smaller than the pools"), line
    assert "256 CPU blocks where its pool has 4096" in line and "--num-cpu-blocks 4096" in line
    assert "--num-gpu-blocks 0" in line and "GPU blocks where" not in line  # the GPU cache was big enough
    assert register(target) == ""  # one rank of a group of 1 registered
    line = explain_refusal(f"FAILED_PRECONDITION: {register(target, tensor_parallel_size=2)}", target)
    assert line.startswith("tensor-parallel size mismatch:"), line
    assert "group of 1 rank(s)" in line and "--tensor-parallel-size 2" in line
    assert "--tensor-parallel-size 1" in line
    assert explain_refusal("RuntimeError: no room", target) == "the workers did not start: RuntimeError: no room"


def test_worker_checks_the_managers_stats_before_starting_ray(default_manager):
    from kvpager.commands import worker_checks

    target = default_manager

    def agrees(*flags: str) -> str:
        try:
            worker_checks.check_manager_agrees(parse("worker", "--manager", target, *flags))
        except cli.Failure as err:
            return str(err)
        return ""

    assert agrees() == ""  # the defaults agree
    assert agrees("--block-size", "16", "--num-gpu-blocks", "4096", "--num-cpu-blocks", "4096") == ""
    assert agrees("--block-size", "8").startswith("block size mismatch:")
    refusal = agrees("--num-gpu-blocks", "100", "--num-cpu-blocks", "10")
    with BlockManagerClient(target) as client:
        pools = client.get_stats()
    gpu, cpu = pools.gpu.total_blocks + 1, pools.cpu.total_blocks  # GetStats' GPU total leaves out the null block
    assert f"100 GPU blocks where its pool has {gpu}, 10 CPU blocks where its pool has {cpu}" in refusal
    assert f"--num-gpu-blocks {gpu} and --num-cpu-blocks {cpu}" in refusal
    # One block short of the pool (the null block included) is refused before Ray, as at registration.
    assert agrees("--num-gpu-blocks", str(gpu - 1), "--num-cpu-blocks", str(cpu)).startswith("cache smaller")
    assert agrees("--num-gpu-blocks", str(gpu), "--num-cpu-blocks", str(cpu)) == ""
    assert register(target, tensor_parallel_size=2, rank=1) == ""
    assert agrees().startswith("tensor-parallel size mismatch:")
    assert agrees("--tensor-parallel-size", "2") == ""


def test_worker_checks_a_manager_waiting_for_its_pools_and_leaves_a_guarded_one_to_registration():
    from kvpager import auth
    from kvpager.commands import worker_checks

    waiting, port, service, _ = create_server(ManagerConfig(num_gpu_blocks=0, num_cpu_blocks=0))  # sized by workers
    tokens = auth.TokenTable.from_json({"tokens": [{"token": "worker-token-0123456789", "role": "worker"}]})
    guarded, guarded_port, guarded_service, _ = create_server(ManagerConfig(), tokens=tokens)
    waiting.start()
    guarded.start()
    try:
        args = parse("worker", "--manager", f"127.0.0.1:{port}", "--block-size", "16")
        worker_checks.check_manager_agrees(args)  # no pools yet: the block size agrees, no pool to compare with
        args = parse("worker", "--manager", f"127.0.0.1:{port}", "--block-size", "8")
        with pytest.raises(cli.Failure, match="block size mismatch"):  # its block size shows without a pool
            worker_checks.check_manager_agrees(args)
        args = parse("worker", "--manager", f"127.0.0.1:{guarded_port}", "--block-size", "8")
        creds = auth.WorkerCredentials(auth_token="worker-token-0123456789")
        assert worker_checks.manager_stats(args.manager, creds) is None  # the worker role may not read stats
        worker_checks.check_manager_agrees(args, credentials=creds)
    finally:
        for server, svc in ((waiting, service), (guarded, guarded_service)):
            server.stop(None)
            svc.close()


def test_worker_with_another_block_size_exits_1_at_once_with_one_line(default_manager):
    started = time.monotonic()
    proc = kvpager("worker", "--insecure", "--manager", default_manager, "--block-size", "32", "--device", "cpu")
    assert_one_line_error(proc, 1, "kvpager worker: block size mismatch:", "--block-size 16", "--block-size 32")
    assert time.monotonic() - started < 30 and "Ray" not in proc.stdout  # before Ray started


def test_the_local_ray_line_says_where_to_join_and_a_joining_worker_presents_the_token(monkeypatch, tmp_path):
    from kvpager.commands import ray_cluster

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    line = ray_cluster.local_ray_line("127.0.0.2:6379")
    assert line.startswith("Ray: started a local cluster at 127.0.0.2:6379,") and "\n" not in line
    assert "--ray-address 127.0.0.2:6379 --join" in line and "token" not in line
    token = tmp_path / "token"
    token.write_text("secret")
    env = {"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN_PATH": str(token)}
    ray_cluster.present_ray_token(env)
    assert env["RAY_AUTH_MODE"] == "disabled"  # an explicit mode stays
    monkeypatch.delenv("RAY_AUTH_MODE")
    assert "(its token: ~/.ray/auth_token)" in ray_cluster.local_ray_line("127.0.0.2:6379")
    env = {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "none")}
    ray_cluster.present_ray_token(env)
    assert "RAY_AUTH_MODE" not in env  # no token here: Ray's default
    env = {"RAY_AUTH_TOKEN_PATH": str(token)}
    ray_cluster.present_ray_token(env)
    assert env["RAY_AUTH_MODE"] == "token"  # as Ray does for the cluster it starts


# ---- bench ---------------------------------------------------------------------------------------
def test_bench_lists_the_benchmarks_with_their_summaries(capsys):
    assert cli.main(["bench", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [[name, file] for name, file in bench.BENCHMARKS.items()]
    assert all(len(line.split(None, 2)) == 3 for line in lines)  # each with its docstring's first sentence


def test_bench_without_a_benchmarks_folder_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "benchmarks_dir", lambda: tmp_path / "benchmarks")
    assert cli.main(["bench", "load"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvpager bench: no benchmarks folder") and err.count("\n") == 1


def test_bench_passes_the_arguments_through():
    proc = kvpager("bench", "load", "--help")
    assert proc.returncode == 0 and "manager_load.py" in proc.stdout and "--requests" in proc.stdout


# ---- stats view ----------------------------------------------------------------------------------
def fake_stats(**overrides) -> pb.GetStatsResponse:
    values = dict(block_size=16, gpu=pb.TierStats(total_blocks=100, used_blocks=50, free_blocks=25, cached_blocks=25),
                  cpu=pb.TierStats(total_blocks=40, used_blocks=10, free_blocks=30), running_sequences=7,
                  swapped_sequences=2, internal_fragmentation=0.125, prefix_caching=True, prefix_query_tokens=16,
                  prefix_hit_tokens=8, prefix_query_blocks=4, prefix_hit_blocks=1, preemptions=3,
                  blocks_swapped_out=12, blocks_swapped_in=9, steps=1000, workers_registered=2, workers_expected=2)
    values.update(overrides)
    return pb.GetStatsResponse(**values)


def test_render_shows_tiers_bars_rates_and_workers():
    previous = stats_view.Sample(fake_stats(steps=900), at=10.0)
    text = "\n".join(stats_view.render("127.0.0.1:50051", stats_view.Sample(fake_stats(), at=12.0), previous))
    gpu = next(line for line in text.splitlines() if line.startswith("gpu"))
    assert gpu.split()[:6] == ["gpu", "100", "50", "25", "25", "50.0%"]
    assert "[" + "#" * 16 + "+" * 8 + "." * 8 + "]" in gpu
    assert "12.5%" in text and "7 running" in text and "2 swapped" in text
    assert "tokens  50.0% (8/16)" in text and "blocks  25.0% (1/4)" in text
    assert "3 preemptions, 12 blocks out, 9 in" in text
    assert "1000 in all, 50.0 per second" in text  # 100 steps in 2 s
    assert "2/2 registered" in text
    first = "\n".join(stats_view.render("x:1", stats_view.Sample(fake_stats(), at=1.0), None))
    assert "- per second" in first


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_screen_redraws_in_place_on_a_terminal_and_appends_blocks_elsewhere():
    plain = io.StringIO()
    screen = stats_view.Screen(plain)
    screen.show(["a", "b"])
    screen.show(["c"])
    assert plain.getvalue() == "a\nb\n\nc\n"
    tty = FakeTTY()
    stats_view.Screen(tty).show(["a"])
    assert tty.getvalue() == stats_view.HOME + "a" + stats_view.CLEAR_LINE + "\n" + stats_view.CLEAR_BELOW
    once = FakeTTY()
    stats_view.Screen(once, live=False).show(["a"])
    assert once.getvalue() == "a\n"


def test_stats_watches_a_running_manager(served):
    client, _ = served
    client.allocate("a", num_tokens=9)
    out = io.StringIO()
    args = parse("stats", "--manager", client.target, "--count", "2", "--interval", "0.05")
    assert stats_view.run(args, out) == 0
    blocks = out.getvalue().split("\n\n" + "kvpager manager")
    assert len(blocks) == 2
    gpu = next(line for line in blocks[-1].splitlines() if line.startswith("gpu"))
    total, used = map(int, gpu.split()[1:3])
    assert pool_total_is(total, 16) and used == 3  # 16 blocks of 4 tokens; 9 tokens use 3


def test_stats_count_on_the_command_line_wins_over_once_from_the_environment(served, monkeypatch):
    client, _ = served
    monkeypatch.setenv("KVPAGER_STATS_ONCE", "1")

    def tables(*flags: str) -> int:
        out = io.StringIO()
        assert stats_view.run(parse("stats", "--manager", client.target, "--interval", "0.05", *flags), out) == 0
        return out.getvalue().count("kvpager manager ")

    assert tables("--count", "3") == 3   # the flag wins over the environment
    assert tables() == 1                 # the environment alone applies
    assert tables("--once") == 1
    monkeypatch.setenv("KVPAGER_STATS_COUNT", "3")
    assert tables("--once") == 1         # a typed --once wins over KVPAGER_STATS_COUNT too
    monkeypatch.delenv("KVPAGER_STATS_ONCE")
    assert tables() == 3


def test_stats_shows_a_manager_waiting_for_its_workers():
    server, port, service, _ = create_server(ManagerConfig(block_size=4, num_gpu_blocks=0, num_cpu_blocks=0))
    server.start()
    try:
        out = io.StringIO()
        assert stats_view.run(parse("stats", "--manager", f"127.0.0.1:{port}", "--once"), out) == 0
    finally:
        server.stop(None)
        service.close()
    assert "not serving stats: no block pool yet" in out.getvalue()


def test_worker_model_is_a_preset_or_a_checkpoint_read_before_any_actor_starts(tmp_path):
    pytest.importorskip("transformers")
    from kvpager.checkpoints import build_random_checkpoint
    from kvpager.commands import worker_checks

    path = build_random_checkpoint(tmp_path / "qwen2", "qwen2", vocab_size=320, tokenizer=False)
    model = worker_checks.model_config(parse("worker", "--manager", "127.0.0.1:1", "--model", str(path)), use_gpu=False)
    assert (model.model_type, model.path, model.dtype) == ("qwen2", str(path), "float32")
    model = worker_checks.model_config(parse("worker", "--manager", "127.0.0.1:1", "--model", str(path)), use_gpu=True)
    assert model.dtype == "bfloat16"
    assert worker_checks.model_config(parse("worker", "--manager", "127.0.0.1:1"), use_gpu=False).path is None  # tiny
    config = (path / "config.json").read_text().replace('"qwen2"', '"phi3"')
    (path / "config.json").write_text(config)
    with pytest.raises(cli.Failure, match="cannot serve --model .*phi3.*llama, mistral, qwen2, qwen3"):
        worker_checks.model_config(parse("worker", "--manager", "127.0.0.1:1", "--model", str(path)), use_gpu=False)


def test_worker_model_errors_a_flag_caused_name_the_flag_not_the_field(tmp_path):
    pytest.importorskip("transformers")
    from kvpager.checkpoints import build_random_checkpoint
    from kvpager.commands import worker_checks

    def refusal(*flags: str) -> str:
        with pytest.raises(cli.Failure) as failure:
            worker_checks.model_config(parse("worker", "--manager", "127.0.0.1:1", *flags), use_gpu=False)
        return str(failure.value)

    assert refusal("--tensor-parallel-size", "3") == (
        "cannot serve --model tiny: --tensor-parallel-size 3 does not divide the 8 attention heads and 4 key/value "
        "heads and 256 intermediate size evenly")
    path = build_random_checkpoint(tmp_path / "llama", tokenizer=False, max_position_embeddings=64)
    line = refusal("--model", str(path), "--max-model-len", "100")
    assert line.startswith(f"cannot serve --model {path}: --max-model-len 100 ") and "max_model_len" not in line
    assert "kvpager serves model types" not in line  # the flag is to blame, not the checkpoint


def test_worker_with_a_model_it_cannot_split_exits_1_before_ray_starts(default_manager):
    proc = kvpager("worker", "--insecure", "--manager", default_manager, "--tensor-parallel-size", "3",
                   "--device", "cpu")
    assert_one_line_error(proc, 1, "kvpager worker: cannot serve --model tiny: --tensor-parallel-size 3 does not divide")
    assert "Ray" not in proc.stdout


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small random Llama with its tokenizer, as README's `build_random_checkpoint` line writes one."""
    pytest.importorskip("transformers")
    from kvpager.checkpoints import build_random_checkpoint

    return build_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", max_position_embeddings=64)


def test_generate_refuses_what_cannot_run_before_anything_starts_naming_the_flags(checkpoint):
    started = time.monotonic()
    proc = kvpager("generate", "--model", str(checkpoint), "--tensor-parallel-size", "3", "hello")
    assert_one_line_error(proc, 1, f"kvpager generate: cannot serve {checkpoint}: --tensor-parallel-size 3 does not "
                                   "divide the 4 attention heads")
    proc = kvpager("generate", "--model", str(checkpoint), "--max-new-tokens", "100", "hello")
    assert_one_line_error(proc, 2, "kvpager generate: error: prompt 1: its ", "tokens and --max-new-tokens 100 "
                                   "exceed the model's context of 64 tokens (--max-model-len)")
    proc = kvpager("generate", "--model", str(checkpoint), "--max-model-len", "100", "hello")
    assert_one_line_error(proc, 1, "--max-model-len 100 beyond the model's max_position_embeddings 64")
    assert time.monotonic() - started < 60  # no Ray, no model load: each a few seconds


def test_generate_ray_or_not_typed_wins_over_the_environment():
    # Either way the command gets past the flags to the checkpoint (exit 1), not "choose one" (exit 2).
    for env, argv in (({"KVPAGER_RAY": "1"}, ["--no-ray"]),
                      ({"KVPAGER_NO_RAY": "1"}, ["--ray", "--tensor-parallel-size", "2"])):
        proc = kvpager("generate", "--model", "/nonexistent", *argv, "hi", env=env)
        assert_one_line_error(proc, 1, "cannot serve /nonexistent: /nonexistent: no such checkpoint directory")
    proc = kvpager("generate", "--model", "/nonexistent", "hi", env={"KVPAGER_RAY": "1", "KVPAGER_NO_RAY": "1"})
    assert_one_line_error(proc, 2, "--ray and --no-ray: choose one")


def test_generate_no_ray_or_ranks_typed_wins_over_the_environment(checkpoint):
    def generate(*argv: str, **env: str) -> subprocess.CompletedProcess:
        return kvpager("generate", "--model", str(checkpoint), *argv, "hello", env=env)

    # The environment's --no-ray ignored: 3 ranks go on to the model's check (exit 1).
    assert_one_line_error(generate("--tensor-parallel-size", "3", KVPAGER_NO_RAY="1"), 1,
                          "--tensor-parallel-size 3 does not divide")
    # The environment's 3 ranks ignored: one rank goes on to the prompt's check (exit 2).
    assert_one_line_error(generate("--no-ray", "--max-new-tokens", "100", KVPAGER_TENSOR_PARALLEL_SIZE="3"), 2,
                          "prompt 1: its ", "exceed the model's context of 64 tokens")
    refusal = "--no-ray runs one worker in this process: --tensor-parallel-size must be 1"
    assert_one_line_error(generate("--no-ray", "--tensor-parallel-size", "2"), 2, refusal)
    assert_one_line_error(generate(KVPAGER_NO_RAY="1", KVPAGER_TENSOR_PARALLEL_SIZE="2"), 2, refusal)


def test_worker_with_a_metrics_port_taken_exits_1_before_ray_starts(default_manager):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1] - 1  # rank 1's port is the taken one
        proc = kvpager("worker", "--insecure", "--manager", default_manager, "--tensor-parallel-size", "2",
                       "--device", "cpu", "--metrics-port", str(port))
    assert_one_line_error(proc, 1, f"kvpager worker: --metrics-port {port}: rank 1's port {port + 1} on 127.0.0.1 "
                                   "is not free (Address already in use)")
    assert "Ray" not in proc.stdout
