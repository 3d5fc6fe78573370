"""The Ray cluster of a command on this machine: joining one as a driver (``connect_ray``),
starting this machine's node of one (``RayNode``: ``ray start --block`` as a child process),
the token a joining node presents, and the line that says where a local cluster is."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Optional

from kvpager.commands import cli

RAY_NODE_START_S = 90.0     # how long a joining Ray node may take to start


class RayNode:
    """A Ray node on this machine joining a cluster: ``ray start --block`` as a child process in its
    own session (so a Ctrl-C reaches only us, and we stop it after the actors)."""

    MARK = "Ray runtime started"  # what `ray start` prints once the node is up

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.tail: deque[str] = deque(maxlen=20)
        self.started = threading.Event()
        threading.Thread(target=self._drain, name="kvpager-ray-node", daemon=True).start()

    @classmethod
    def start(cls, address: str, node_ip: Optional[str], device: str, tensor_parallel_size: int) -> "RayNode":
        check_reachable(address, "the Ray cluster")
        command = [_ray_cli(), "start", "--address", address, "--block", "--disable-usage-stats"]
        if node_ip:
            command += ["--node-ip-address", node_ip]
        if device == "cpu":  # room for one CPU actor per rank, whatever Ray detects; no GPUs
            command += ["--num-gpus", "0", "--num-cpus", str(max(tensor_parallel_size, os.cpu_count() or 1))]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        node = cls(proc)
        try:
            deadline = time.monotonic() + RAY_NODE_START_S
            while not node.started.wait(0.2):
                if proc.poll() is not None or time.monotonic() > deadline:
                    why = node.last_error() or (f"it exited with status {proc.returncode}" if proc.poll() is not None
                                                else f"not started after {RAY_NODE_START_S:g} s")
                    raise cli.Failure(f"could not join the Ray cluster at {address} (ray start): {why}")
        except BaseException:  # a failure, or SIGTERM/Ctrl-C while waiting: the node goes too
            node.stop()
            raise
        return node

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.tail.append(line.rstrip())
            if self.MARK in line:
                self.started.set()

    def last_error(self) -> str:
        lines = [line for line in self.tail if "ERROR" in line or "Error" in line] or list(self.tail)[-1:]
        return lines[-1].split(" -- ", 1)[-1].strip() if lines else ""

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _ray_cli() -> str:
    """The `ray` script of this Python's environment (PATH may hold another one)."""
    beside = os.path.join(os.path.dirname(sys.executable), "ray")
    return beside if os.access(beside, os.X_OK) else "ray"


def check_reachable(target: str, what: str, timeout: float = 5.0) -> None:
    """A TCP connect first: Ray waits a long while on an address that does not answer."""
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as err:
        raise cli.Failure(f"cannot reach {what} at {target}: {err.strerror or err}") from err


RAY_AUTH_MODE = "RAY_AUTH_MODE"


def local_ray_line(address: str) -> str:
    """What this command says about the Ray cluster it started: where, and how to join it."""
    auth = "" if os.environ.get(RAY_AUTH_MODE, "").lower() == "disabled" else " (its token: ~/.ray/auth_token)"
    return (f"Ray: started a local cluster at {address}{auth}, stopped with this command; join it from this "
            f"machine with --ray-address {address} --join --node-ip 127.0.0.3")


def present_ray_token(env: dict = os.environ) -> None:
    """Joining a Ray cluster: where this machine holds a Ray token and RAY_AUTH_MODE is unset, set
    it to token, as Ray itself does when it starts a local cluster, so that a cluster with token
    authentication (one another `kvpager worker` started here) lets `ray start --address` and this
    driver in. Before Ray is imported: it reads the mode once."""
    token_file = env.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if RAY_AUTH_MODE not in env and (env.get("RAY_AUTH_TOKEN") or os.path.isfile(token_file)):
        env[RAY_AUTH_MODE] = "token"


def connect_ray(address: str, namespace: str, node_ip: Optional[str] = None) -> None:
    """Connect this process to the Ray cluster at ``address`` as a driver, through the Ray node
    that runs on this machine (with ``node_ip``: the one advertising that IP)."""
    import ray

    check_reachable(address, "the Ray cluster")
    options = {"_node_ip_address": node_ip} if node_ip else {}
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, **options)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise cli.Failure(f"cannot connect to the Ray cluster at {address}: {cli.one_line(err)} (is a Ray node "
                          "running on this machine? `kvpager worker --join` starts one)") from err
