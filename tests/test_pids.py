"""materl/pids.py: the one liveness check for files that name their writer's pid."""

import os
import subprocess
import sys

from materl.pids import alive


def test_own_pid_counts_as_the_caller_says():
    assert alive(os.getpid(), count_self=True) is True
    assert alive(os.getpid(), count_self=False) is False  # a lock or temp folder left by an earlier attempt of ours


def test_a_running_child_is_alive_and_a_reaped_one_is_not():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert alive(child.pid, count_self=False) is True
    finally:
        child.kill()
        child.wait()
    assert alive(child.pid, count_self=False) is False  # reaped: no such process (pids are not reused this soon)
