"""The fleet's supervisor on its own (issue 54): a replica that dies is reported once, started again after its
delay, and reported back once it answers ``/health``; a replica that dies right after starting waits longer.
The replica here is a few lines of Python serving ``/health``, so the test takes seconds, not a model load."""

from __future__ import annotations

import os
import signal
import sys
import time

from patchbay.entrypoints.serve.fleet.command import free_port
from patchbay.entrypoints.serve.fleet.replicas import Replica, ReplicaChanges, ReplicaSet

HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def health_replica(rank: int) -> Replica:
    port = free_port()
    command = [sys.executable, "-c", HEALTH_SERVER, str(port)]
    return Replica(rank, "127.0.0.1", port, sorted(os.sched_getaffinity(0))[:1], command, {})


def supervise_until(replica_set: ReplicaSet, wanted, timeout: float = 30.0) -> list[ReplicaChanges]:  # noqa: ANN001
    """Supervise every 50 ms until ``wanted(changes)`` holds for a round; every round's changes."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        changes = replica_set.supervise_once()
        seen.append(changes)
        if wanted(changes):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {seen[-3:]}")


def test_a_dead_replica_is_reported_restarted_and_reported_back_when_it_serves():
    replicas = [health_replica(0), health_replica(1)]
    replica_set = ReplicaSet(replicas, restart_delay=0.2)
    replica_set.start()
    try:
        replica_set.wait_until_healthy(30)
        assert replica_set.supervise_once() == ReplicaChanges()  # all well: nothing to tell the router

        victim = replicas[1]
        first_pid = victim.process.pid
        os.kill(first_pid, signal.SIGKILL)
        victim.process.wait()
        rounds = supervise_until(replica_set, lambda changes: changes.back)
        died = [replica.rank for changes in rounds for replica in changes.died]
        back = [replica.rank for changes in rounds for replica in changes.back]
        assert died == [1] and back == [1]  # once each, and only the victim
        assert victim.process.pid != first_pid and victim.healthy()
        assert victim.deaths == ["killed by signal 9"] and victim.restarts == 1
        assert victim.delay == 0.4  # it died within a minute of its start: the next delay doubles
        assert replicas[0].restarts == 0 and replicas[0].deaths == []
    finally:
        replica_set.stop(10)
