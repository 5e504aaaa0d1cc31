"""Data parallel on Ray (``-dp 2 --distributed-executor-backend ray``, Ray on loopback with usage
statistics off): the checks test_server_dp.py makes of the mp backend, run against replicas that
are Ray actors. A client that disconnects aborts its request on the owning replica, whose KV usage
returns to idle; SIGTERM drains both replicas (their streams finish, exit code 0); a replica actor's
process killed mid-stream ends every in-flight stream with an error, new requests get 503 and the
server exits non-zero. The replicas' CPUs are planned on the node Ray placed them on: on this one
host, the driver's own plan (each its own core), and the banner names the host.
(Streams equal DP=1's text over Ray: test_server_dp.py::test_dp2_ray_streams_equal_dp1.)"""
from __future__ import annotations

import re
import socket

import pytest

import test_server_dp as dp
from test_server_dp import FLAGS, needs_two, slow_model_dir  # noqa: F401  (the module's model fixture)

RAY = ("-dp", "2", "--distributed-executor-backend", "ray")
ENV = {"RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def ray_dp2(start_server, slow_model_dir):  # noqa: F811
    pytest.importorskip("ray", reason="the ray extra is not installed here")  # installed in CI (pyproject)
    srv = start_server(slow_model_dir, *FLAGS, *RAY, "--shutdown-timeout", "300", env=ENV, startup_timeout=300)
    yield srv
    srv.stop()
    assert "Traceback" not in srv.output(), srv.output()


@needs_two
def test_ray_replicas_are_actors_on_their_own_cores(ray_dp2):
    out = ray_dp2.output()
    assert "2 replicas (ray)" in out, out
    rows = re.findall(r"data-parallel replica (\d+): pid (\d+), 1 threads on CPUs ([\d,-]+), \d+ KV blocks, "
                      r"host (\S+)", out)
    assert len(rows) == 2, out
    from appliance.runtime.threads import parse_cpu_list

    (_, p0, c0, h0), (_, p1, c1, h1) = rows
    assert p0 != p1 and not set(parse_cpu_list(c0)) & set(parse_cpu_list(c1)), rows
    assert h0 == h1 == socket.gethostname(), rows


@needs_two
def test_ray_disconnect_aborts_on_owning_replica(ray_dp2):
    dp.test_disconnect_aborts_on_owning_replica(ray_dp2)


@needs_two
def test_ray_sigterm_drains_both_replicas(ray_dp2):
    """The module's last use of the Ray DP=2 server."""
    dp.test_sigterm_drains_both_replicas(ray_dp2)


@needs_two
def test_ray_killed_replica_fails_requests_and_stops_server(start_server, slow_model_dir):  # noqa: F811
    pytest.importorskip("ray", reason="the ray extra is not installed here")
    dp.check_killed_replica(start_server(slow_model_dir, *FLAGS, *RAY, env=ENV, startup_timeout=300))
