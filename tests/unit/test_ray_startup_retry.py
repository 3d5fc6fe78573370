"""``init_local_ray`` starts a local Ray cluster again when Ray's start-up timed out (a loaded
machine), up to ``STARTS`` times, and raises anything else at once. A stand-in ``ray`` module
records the calls; no cluster is started."""

from __future__ import annotations

import sys
import types

import pytest

from kvpager.worker import ray_group

GCS_TIMEOUT = "Timed out waiting for file /tmp/kvray-x/ray/session_1/gcs_server_port_abc"
NODE_TIMEOUT = "The current node timed out during startup."


def fake_ray(monkeypatch, failures: list[str]) -> types.SimpleNamespace:
    """A ``ray`` whose init raises each of ``failures`` in turn, then starts."""
    calls = types.SimpleNamespace(init=0, shutdown=0, up=False)

    def init(**_kwargs):
        calls.init += 1
        if failures:
            raise RuntimeError(failures.pop(0))
        calls.up = True

    def shutdown():
        calls.shutdown += 1

    module = types.ModuleType("ray")
    module.init, module.shutdown, module.is_initialized = init, shutdown, lambda: calls.up
    monkeypatch.setitem(sys.modules, "ray", module)
    monkeypatch.setattr(ray_group.time, "sleep", lambda _s: None)
    return calls


def test_startup_timeouts_are_retried_until_a_start_works(monkeypatch):
    calls = fake_ray(monkeypatch, [NODE_TIMEOUT, GCS_TIMEOUT])
    ray_group.init_local_ray(num_cpus=2)
    assert (calls.init, calls.shutdown, calls.up) == (3, 2, True)


def test_startup_timeouts_past_the_last_try_are_raised(monkeypatch):
    calls = fake_ray(monkeypatch, [GCS_TIMEOUT] * ray_group.STARTS)
    with pytest.raises(RuntimeError, match="gcs_server_port"):
        ray_group.init_local_ray(num_cpus=2)
    assert calls.init == ray_group.STARTS and not calls.up


def test_the_gcs_port_wait_is_lengthened_unless_an_operator_set_it(monkeypatch):
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "")   # (records the variable's state for undo)
    monkeypatch.delenv("RAY_gcs_server_port_wait_time_s")
    fake_ray(monkeypatch, [])
    ray_group.init_local_ray(num_cpus=2)
    assert ray_group.os.environ["RAY_gcs_server_port_wait_time_s"] == ray_group.GCS_PORT_WAIT_S
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "7")
    fake_ray(monkeypatch, [])
    ray_group.init_local_ray(num_cpus=2)
    assert ray_group.os.environ["RAY_gcs_server_port_wait_time_s"] == "7"


def test_other_start_errors_are_raised_at_once(monkeypatch):
    calls = fake_ray(monkeypatch, ["address 127.0.0.2 is not a local address"])
    with pytest.raises(RuntimeError, match="not a local address"):
        ray_group.init_local_ray(num_cpus=2)
    assert calls.init == 1
