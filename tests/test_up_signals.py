"""`pardec up` as a process manager sees it: a signal while its services load stops it then,
and its services (Redis among them) die with a supervisor that is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PARDEC = [sys.executable, "-m", "pardec.gateway.cli"]


def test_pardec_up_stops_on_sigterm_while_starting_and_redis_dies_with_it(tmp_path):
    """A signal to the supervisor alone (a process manager's) stops it while its services load,
    not once they serve; and Redis, like every service, dies with a supervisor that is killed."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    for how, workdir in ((signal.SIGTERM, tmp_path / "term"), (signal.SIGKILL, tmp_path / "kill")):
        process = subprocess.Popen([*PARDEC, "up", "--gateway-addr", "127.0.0.1:0", "--workdir", str(workdir)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + 120
        while not (workdir / "redis" / "redis.sock").exists():  # Redis is up, the verifier loading
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        process.send_signal(how)
        assert process.wait(timeout=60) == (0 if how == signal.SIGTERM else -signal.SIGKILL)
        if how == signal.SIGTERM:  # stopped while loading: no service got to serve
            assert not list(workdir.glob("verifier*.addr")), process.stderr.read()
        for _ in range(100):  # a killed supervisor's children get SIGTERM from the kernel: a moment
            if not subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True).stdout.strip():
                break
            time.sleep(0.1)
        assert not subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True).stdout.strip()
