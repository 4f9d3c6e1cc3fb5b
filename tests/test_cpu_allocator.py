"""materl.cpu_allocator: compute work's CPU tensors from a range of their own, best fit, merged on
free; other code's from glibc.

Placement is checked in fresh subprocesses (nothing else has allocated there); the pytest process
itself runs with the allocator installed once any compute work has run (``compute.tune_allocator``).
"""

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from materl import compute, cpu_allocator

pytestmark = pytest.mark.skipif(not cpu_allocator.install(), reason=f"no allocator: {cpu_allocator.unavailable()}")


def _run(code: str, **env: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env}, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_large_tensors_come_from_the_range_small_ones_from_glibc():
    before = cpu_allocator.stats()["in_use"]
    with cpu_allocator.scope():
        big, small = torch.full((1 << 18,), 3.0), torch.ones(16)
    assert cpu_allocator.owns(big) and not cpu_allocator.owns(small)
    assert cpu_allocator.stats()["in_use"] >= before + big.nbytes
    assert float(big.sum()) == 3.0 * (1 << 18)
    del big  # freed outside the scope: back to the range all the same
    assert cpu_allocator.stats()["in_use"] == before


def test_only_compute_work_and_scopes_use_the_range():
    outside = torch.empty(1 << 18)
    work = compute.call(torch.empty, 1 << 18)
    with cpu_allocator.scope():
        with cpu_allocator.scope():
            nested = torch.empty(1 << 18)
        after_inner = torch.empty(1 << 18)
    assert [cpu_allocator.owns(t) for t in (outside, work, nested, after_inner)] == [False, True, True, True]
    assert not cpu_allocator.owns(torch.empty(1 << 18))


def test_best_fit_and_freed_neighbours_merge():
    out = _run("""
        import torch
        from materl import cpu_allocator
        assert cpu_allocator.install()
        inside = cpu_allocator.scope(); inside.__enter__()  # for the rest of the script
        MiB = 1 << 20
        t = lambda n: torch.empty(n, dtype=torch.uint8)
        a, b, c, d, guard = t(MiB), t(MiB), t(MiB), t(3 * MiB), t(64 << 10)
        start = a.data_ptr()
        assert [x.data_ptr() - start for x in (b, c, d, guard)] == [MiB, 2 * MiB, 3 * MiB, 6 * MiB]
        del a, b, d                       # free: [0, 2 MiB) merged, and [3, 6 MiB)
        assert cpu_allocator.stats()["free_blocks"] == 2
        two = t(2 * MiB)                  # fits both holes; best fit takes the exact one
        three = t(3 * MiB)
        print(two.data_ptr() - start, three.data_ptr() - start, cpu_allocator.stats()["free_blocks"])
    """)
    assert out.split() == [str(0), str(3 << 20), "0"]


def test_freed_memory_stays_resident_for_reuse():
    out = _run("""
        import resource, torch
        from materl import cpu_allocator
        assert cpu_allocator.install()
        inside = cpu_allocator.scope(); inside.__enter__()  # for the rest of the script
        faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        big = torch.ones(300 << 20)       # 1200 MiB, written: ~300,000 page faults
        at, top = big.data_ptr(), cpu_allocator.stats()["top"]
        del big
        before = faults()
        again = torch.full((300 << 20,), 2.0)
        print(again.data_ptr() == at, cpu_allocator.stats()["top"] == top, faults() - before)
    """)
    same_place, same_top, faults = out.split()
    assert same_place == same_top == "True" and int(faults) < 1000


def test_threads_allocating_at_once_keep_their_data():
    before = cpu_allocator.stats()["in_use"]
    errors = []

    def work(k: int) -> None:
        with cpu_allocator.scope():
            churn(k)

    def churn(k: int) -> None:
        gen = torch.Generator().manual_seed(k)
        live = []
        for i in range(150):
            n = int(torch.randint(1 << 10, 1 << 20, (1,), generator=gen))
            live.append(torch.full((n,), float(k * 1000 + i)))
            if len(live) > 8:
                x = live.pop(int(torch.randint(0, len(live), (1,), generator=gen)))
                if not bool((x == x[0]).all()):
                    errors.append(k)
        for x in live:
            if not bool((x == x[0]).all()):
                errors.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert cpu_allocator.stats()["in_use"] == before


def test_a_forked_child_allocates():
    out = _run("""
        import os, torch
        from materl import cpu_allocator
        assert cpu_allocator.install()
        inside = cpu_allocator.scope(); inside.__enter__()  # for the rest of the script
        x = torch.ones(1 << 20)
        pid = os.fork()
        if pid == 0:
            y = torch.full((1 << 20,), 2.0)
            os._exit(0 if cpu_allocator.owns(y) and float(x.sum() + y.sum()) == 3 * (1 << 20) else 1)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """, OMP_NUM_THREADS="1")  # libgomp's thread pool does not survive fork(), whatever the allocator
    assert out.strip() == "0"


def test_profiler_still_sees_cpu_memory():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with cpu_allocator.scope():
            x = torch.ones(1 << 20)
        assert cpu_allocator.owns(x)
        del x
    sizes = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage]
    assert 4 << 20 in sizes and -(4 << 20) in sizes


@pytest.mark.parametrize("cxx, why", [("/nonexistent/c++", "nonexistent"), ("/bin/false", "failed to build")])
def test_without_a_working_compiler_glibc_serves_everything(tmp_path, cxx, why):
    out = _run("""
        import torch
        from materl import compute, cpu_allocator
        assert compute.tune_allocator()   # glibc's settings still apply
        x = torch.ones(1 << 20)
        print(cpu_allocator.install(), cpu_allocator.owns(x), float(x.sum()))
        print(cpu_allocator.unavailable())
    """, CXX=cxx, MATERL_CACHE_DIR=str(tmp_path))
    first, reason = out.strip().split("\n", 1)
    assert first == f"False False {float(1 << 20)}"
    assert why in reason


@pytest.mark.parametrize("setting", ["", "glibc", "default"])
def test_compute_installs_it_unless_materl_malloc_says_not(setting):
    out = _run("""
        from materl import compute, cpu_allocator
        print(compute.tune_allocator(), cpu_allocator.unavailable())
    """, MATERL_MALLOC=setting)
    assert out.split() == [str(setting != "default"), "None" if not setting else f"MATERL_MALLOC={setting}"]


def test_training_gives_the_same_bits_with_either_allocator():
    code = """
        import hashlib, materl as ml
        from materl import cpu_allocator
        from materl.recipes import grpo
        policy = ml.Agent("tiny-random", trainable=True, engine="transformers")
        step = ml.compile(grpo, policy=policy, ref_policy=ml.Agent("tiny-random", engine="transformers"),
                          group_size=4, max_new_tokens=8, lr=1e-3, seed=3)
        for _ in range(2):
            step.run(["Count to three.", "Name a colour."])
        h = hashlib.sha256()
        for name, t in sorted(policy.model.state_dict().items()):
            h.update(name.encode()); h.update(t.detach().contiguous().numpy().tobytes())
        print(cpu_allocator.unavailable() is None, h.hexdigest())
    """
    region, glibc = _run(code).split(), _run(code, MATERL_MALLOC="glibc").split()
    assert region[0] == "True" and glibc[0] == "False"
    assert region[1] == glibc[1]
