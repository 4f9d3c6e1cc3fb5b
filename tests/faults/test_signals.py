"""SIGINT and SIGTERM sent to a real ``materl train`` at different moments: it exits with 130 /
143 and says why, its last complete checkpoint loads and verifies against its manifest, and no
process it started (the calculator MCP server, Ray's) is left; a second signal exits at once.
How each moment is reached: tests/faults/conftest.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

from materl.runtime.checkpoint import load_checkpoint

from .conftest import CALCULATOR, assert_no_leftovers, family, signal_and_wait, start_run


def latest_step(run_dir) -> int:
    """The step of the run's latest checkpoint, after checking every file against its manifest."""
    return load_checkpoint(run_dir, fallback=False).step


def test_sigint_while_starting_exits_130_with_no_checkpoint(tmp_path):
    child, run_dir = start_run(tmp_path, "start")
    code, err = signal_and_wait(child, signal.SIGINT)
    assert code == 130, err
    assert "SIGINT received: stopping" in err and "materl train: interrupted (SIGINT received), exit 130" in err
    assert not (run_dir / "checkpoints").exists()
    assert_no_leftovers(child)


def test_sigterm_while_decoding_exits_143_and_keeps_the_checkpoint(tmp_path):
    child, run_dir = start_run(tmp_path, "decode")
    code, err = signal_and_wait(child, signal.SIGTERM)
    assert code == 143, err
    assert "materl train: interrupted (SIGTERM received), exit 143" in err
    assert "Traceback" not in err
    assert latest_step(run_dir) == 1  # held in step 2's rollout: step 1's checkpoint is the last
    assert_no_leftovers(child)


def test_sigint_in_the_learner_stops_the_tool_server(tmp_path):
    child, run_dir = start_run(tmp_path, "learner", *CALCULATOR)
    started = family(child)
    assert any("materl.tools.calculator" in cmd for cmd in started.values()), started
    code, err = signal_and_wait(child, signal.SIGINT)
    assert code == 130, err
    assert "Traceback" not in err
    assert latest_step(run_dir) == 1  # step 2's update was cut short and not saved
    assert_no_leftovers(child, started)


def test_sigterm_during_a_save_lets_it_finish(tmp_path):
    # held 3 s inside step 2's save (every file but the manifest written): the signal waits for it
    child, run_dir = start_run(tmp_path, "save", *CALCULATOR, pause=3.0)
    started = family(child)
    code, err = signal_and_wait(child, signal.SIGTERM)
    assert code == 143, err
    assert latest_step(run_dir) == 2  # the save completed, and is the latest
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert_no_leftovers(child, started)


def test_second_signal_exits_at_once(tmp_path):
    # held 120 s inside step 2's save, where a first signal waits: only the second can end it soon
    child, run_dir = start_run(tmp_path, "save", *CALCULATOR, pause=120.0)
    started = family(child)
    os.kill(child.pid, signal.SIGTERM)
    time.sleep(1.0)
    assert child.poll() is None  # the first signal waits for the save
    code, err = signal_and_wait(child, signal.SIGINT, timeout=20.0)
    assert code == 130, err  # 128 + SIGINT: the second signal's exit
    assert "second signal: killing child processes and exiting now" in err
    assert latest_step(run_dir) == 1  # the cut-short save is only a temp folder; step 1 stays the latest
    assert_no_leftovers(child, started)


@pytest.mark.slow  # starts a local Ray cluster: ~30 s on an idle 2-core machine
def test_sigterm_with_a_ray_rollout_worker(tmp_path):
    pytest.importorskip("ray")
    child, run_dir = start_run(tmp_path, "learner", "--set", "distributed.workers=1")
    started = family(child)
    assert any("raylet" in cmd for cmd in started.values()), started  # a local Ray cluster materl started
    code, err = signal_and_wait(child, signal.SIGTERM)
    assert code == 143, err  # not -6: Ray's own SIGTERM handler aborted the driver
    assert "materl train: interrupted (SIGTERM received), exit 143" in err
    assert latest_step(run_dir) == 1
    assert_no_leftovers(child, started, within_s=15.0)  # Ray's processes stop asynchronously
