"""materl.runtime.signals in this process: a first signal raises Interrupted (exit code 128 + n),
``deferred()`` holds it to the end of its block, descendants are found and stopped. The real
thing, a signalled ``materl train``: tests/faults/test_signals.py."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from materl.errors import Interrupted
from materl.runtime import signals


def test_a_signal_raises_interrupted_with_the_shell_exit_code():
    before = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or Ray's if an earlier test ran ray.init here
    with signals.handled():
        with pytest.raises(Interrupted) as caught:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # interrupted well before this ends
        assert signals.received() == signal.SIGTERM
    assert caught.value.signum == signal.SIGTERM and caught.value.exit_code == 143  # 128 + 15
    assert isinstance(caught.value, KeyboardInterrupt) and not isinstance(caught.value, Exception)
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back


def test_deferred_holds_the_signal_until_the_block_ends():
    finished = []
    with signals.handled():
        with pytest.raises(Interrupted) as caught:
            with signals.deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)  # the handler has run by now, and did not raise
                finished.append(True)
    assert finished == [True] and caught.value.exit_code == 130  # 128 + 2


KILLER = """
import json, subprocess, sys, time
from materl.runtime import signals
child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"])
deadline = time.monotonic() + 30
while len(signals.descendants()) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
family = signals.descendants()
killed = signals.kill_descendants(grace_s=1.0)
child.wait(timeout=10)
time.sleep(0.2)
print(json.dumps({"child": child.pid, "family": family, "killed": killed,
                  "alive": [p for p in family if signals._alive(p)]}))
"""


def test_kill_descendants_stops_children_and_grandchildren():
    # in a process of its own, whose only descendants are a sleeping child and grandchild
    out = json.loads(subprocess.run([sys.executable, "-c", KILLER], capture_output=True, text=True, timeout=120,
                                    check=True).stdout)
    assert out["child"] in out["family"] and len(out["family"]) == 2
    assert sorted(out["killed"]) == sorted(out["family"]) and out["alive"] == []
