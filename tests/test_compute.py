"""materl.compute: torch's heavy work runs in one thread, whichever thread asks for it."""

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import anyio
import pytest

import materl as ml
from materl import compute
from materl.compiler.learner import Learner
from materl.engines.transformers_engine import TransformersEngine


def test_call_runs_in_the_compute_thread_from_any_thread():
    home = compute.compute_thread()
    assert home is not threading.current_thread()  # no serving thread here: the daemon
    with ThreadPoolExecutor(2) as pool:
        seen = list(pool.map(lambda _: compute.call(threading.current_thread), range(4)))
    assert seen == [home] * 4


def test_call_from_the_compute_thread_runs_inline():
    # a compute item that itself calls compute.call would deadlock if it queued behind itself
    assert compute.call(lambda: compute.call(lambda: threading.current_thread().name)) == "materl-compute"


def test_errors_reach_the_caller():
    with pytest.raises(ZeroDivisionError):
        compute.call(lambda: 1 / 0)


def test_serving_thread_runs_work_until_its_future_is_done():
    me = threading.current_thread()
    done: Future = Future()
    ran_in = []

    def producer():
        ran_in.append(compute.call(threading.current_thread))
        ran_in.append(compute.call(lambda: threading.current_thread()))
        done.set_result("finished")

    with compute.serving() as here:
        assert compute.compute_thread() is me
        worker = threading.Thread(target=producer)
        worker.start()
        assert here.until(done) == "finished"
        worker.join()
    assert ran_in == [me, me]
    assert compute.compute_thread() is not me  # back to the daemon once serving ends


def test_work_left_after_serving_is_handed_to_the_next_thread():
    with compute.serving() as here:
        item = here.submit(threading.current_thread, (), {})  # queued, never served here
    assert item.result(timeout=10) is compute.compute_thread()


async def test_acall_keeps_the_event_loop_running():
    ticks = []

    async def ticker():
        for _ in range(5):
            ticks.append(time.perf_counter())
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        thread = await compute.acall(lambda: (time.sleep(0.1), threading.current_thread())[1])
    assert thread is compute.compute_thread()
    assert len(ticks) == 5 and ticks[-1] - ticks[0] < 0.1  # the loop ticked while the work slept


def test_compiled_run_decodes_and_learns_in_the_calling_thread(monkeypatch):
    """One thread holds torch's OpenMP pool: the engine's batches and the learner both run in
    the thread blocked in ``run`` (not the event loop's, not an anyio worker)."""
    threads: dict[str, set] = {"decode": set(), "learn": set()}

    def spy(kind, fn):
        def wrapped(*args, **kwargs):
            threads[kind].add(threading.current_thread())
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(TransformersEngine, "_decode_batch", spy("decode", TransformersEngine._decode_batch))
    monkeypatch.setattr(Learner, "run", spy("learn", Learner.run))
    from materl.recipes import grpo

    step = ml.compile(grpo, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                      group_size=2, max_new_tokens=4, lr=1e-3)
    try:
        metrics = step.run(["Count to three.", "Name a colour."])
    finally:
        step.close()
    assert metrics["step"] == 1.0
    assert threads == {"decode": {threading.current_thread()}, "learn": {threading.current_thread()}}
