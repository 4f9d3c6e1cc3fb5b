"""The background event loop of blocking calls: it stops on close, on garbage collection, and
never holds up interpreter exit."""

import gc
import subprocess
import sys
import textwrap
import threading

from materl.compiler.loop import LoopThread


async def _add(a, b):
    return a + b


def _loop_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


def test_submit_close_and_reopen():
    loop = LoopThread("materl-test-loop-1")
    assert loop.call(_add, 2, 3) == 5 and loop.running
    assert len(_loop_threads("materl-test-loop-1")) == 1
    loop.close()
    loop.close()  # idempotent
    assert not loop.running and not _loop_threads("materl-test-loop-1")
    assert loop.call(_add, 1, 1) == 2  # a closed loop starts again on the next call
    loop.close()


def test_collected_without_close_stops_its_thread():
    loop = LoopThread("materl-test-loop-2")
    loop.call(_add, 0, 0)
    del loop
    gc.collect()
    assert not _loop_threads("materl-test-loop-2")


def test_a_compiled_step_left_open_does_not_hang_interpreter_exit():
    script = textwrap.dedent("""
        import materl as ml
        from materl.recipes import grpo
        step = ml.compile(grpo, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                          group_size=2, max_new_tokens=4)
        step.run(prompts=["a"])
        keep = [step]   # neither closed nor collected before shutdown
        print("ran")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ran")


def test_cancel_runs_the_tasks_cleanup_before_the_future_is_done():
    import asyncio
    from concurrent.futures import CancelledError

    import pytest

    cleaned: list[str] = []
    started = threading.Event()

    async def forever():
        try:
            started.set()
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.1)  # an async clean-up (e.g. closing a tool server) that takes a while
            cleaned.append("done")

    loop = LoopThread("materl-test-loop-cancel")
    future = loop.submit(forever)
    assert started.wait(10)
    loop.cancel(future)
    with pytest.raises(CancelledError):
        future.result(timeout=10)
    assert cleaned == ["done"]  # the future was done only after the finally block ran
    assert loop.call(_add, 1, 2) == 3  # and the loop still serves
    loop.close()
