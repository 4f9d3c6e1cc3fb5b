"""materl.compute: torch's heavy work runs in one thread, whichever thread asks for it."""

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import anyio
import pytest

import materl as ml
from materl import compute
from materl.compiler.learner import Learner
from materl.engines.mojo_engine import MojoEngine
from materl.engines.transformers_engine import TransformersEngine


def test_call_without_a_serving_thread_runs_in_the_caller():
    # e.g. Agent.model loading from a script's main thread, which later serves Compiled.run
    with ThreadPoolExecutor(2) as pool:
        pairs = list(pool.map(lambda _: (threading.current_thread(), compute.call(threading.current_thread)), range(4)))
    assert all(caller is ran for caller, ran in pairs)


async def test_acall_without_a_serving_thread_uses_one_daemon_thread():
    seen = {await compute.acall(threading.current_thread) for _ in range(3)}
    assert len(seen) == 1 and seen.pop().name == "materl-compute"


def test_call_from_the_compute_thread_runs_inline():
    # a compute item that itself calls compute.call would deadlock if it queued behind itself
    with compute.serving() as here:
        me = threading.current_thread()
        with ThreadPoolExecutor(1) as pool:
            inner = pool.submit(compute.call, lambda: compute.call(threading.current_thread))
            assert here.until(inner) is me


async def test_errors_reach_the_caller():
    with pytest.raises(ZeroDivisionError):
        await compute.acall(lambda: 1 / 0)


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
    assert compute.compute_thread().name == "materl-compute"  # back to the daemon once serving ends


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
    monkeypatch.setattr(MojoEngine, "_step", spy("decode", MojoEngine._step))  # whichever engine is the default
    monkeypatch.setattr(Learner, "run_updates", spy("learn", Learner.run_updates))
    from materl.recipes import grpo

    step = ml.compile(grpo, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                      group_size=2, max_new_tokens=4, lr=1e-3)
    try:
        metrics = step.run(["Count to three.", "Name a colour."])
    finally:
        step.close()
    assert metrics["step"] == 1.0
    assert threads == {"decode": {threading.current_thread()}, "learn": {threading.current_thread()}}


def test_an_interrupt_in_served_work_stays_in_the_serving_thread():
    """Ctrl-C while the serving thread runs an item: the interrupt goes up that thread, the task
    that awaited the item gets WorkInterrupted, and the loop's thread lives on (it used to die of
    the re-raised KeyboardInterrupt, leaving the serving thread waiting for ever)."""
    from materl.compiler.loop import LoopThread
    from materl.errors import WorkInterrupted

    def ctrl_c():
        raise KeyboardInterrupt

    seen: list[BaseException] = []

    async def step():
        try:
            await compute.acall(ctrl_c)
        except BaseException as exc:
            seen.append(exc)
            raise

    loop = LoopThread("materl-test-interrupt")
    with compute.serving() as here:
        future = loop.submit(step)
        with pytest.raises(KeyboardInterrupt):
            here.until(future)
        with pytest.raises(WorkInterrupted, match="ctrl_c was interrupted"):
            here.until(future, timeout_s=10)
    assert [type(e) for e in seen] == [WorkInterrupted]
    assert loop.call(_async_add, 2, 3) == 5  # the loop's thread survived
    loop.close()


async def _async_add(a, b):
    return a + b
