"""The Mojo engine's thread-count chooser: the cheaper option almost always, the other tried at
doubling intervals (8, 16, ... up to 128 calls) while the tries confirm the choice, and again
after 8 calls when the choice changes. Pure Python: the seconds are given, not measured."""

from materl.engines.mojo_forward import ThreadChooser


def run(chooser: ThreadChooser, seconds: dict[int, float], calls: int, rows: int = 8) -> list[int]:
    picks = []
    for _ in range(calls):
        t = chooser.pick()
        chooser.record(t, seconds[t], rows)
        picks.append(t)
    return picks


def tries(picks: list[int], other: int) -> list[int]:
    return [i for i, t in enumerate(picks) if t == other]


def test_the_other_option_is_tried_at_doubling_intervals():
    chooser = ThreadChooser(2)
    picks = run(chooser, {1: 0.061, 2: 0.035}, 1000)
    assert picks[:2] == [2, 1]  # each option once, the larger thread count first
    at = tries(picks, 1)[1:]  # after the first measurement
    gaps = [b - a for a, b in zip(at, at[1:])]
    assert gaps[:4] == [16, 32, 64, 128] and set(gaps[4:]) == {128}
    assert at[0] == 2 + 8  # 8 calls after the choice was first made (at index 2)
    assert picks.count(1) <= 12  # 1.2% of the calls, against 12.5% when every 8th call tried it


def test_a_change_in_cost_switches_the_choice_and_resets_the_interval():
    chooser = ThreadChooser(2)
    run(chooser, {1: 0.061, 2: 0.035}, 600)  # settled: tries every 128 calls
    picks = run(chooser, {1: 0.061, 2: 0.300}, 300)  # two threads now stall (a busy machine)
    switched = picks.index(1)
    assert switched <= 3  # the running option's own cost rises; no try needed
    assert all(t == 1 for t in picks[switched:switched + 8])
    back = tries(picks[switched:], 2)
    assert back[0] == 8 and back[1] - back[0] == 16  # the intervals start over at 8


def test_one_thread_only():
    chooser = ThreadChooser(1)
    assert set(run(chooser, {1: 0.05}, 50)) == {1}


def test_prefill_and_decode_calls_keep_separate_estimates():
    """A rollout starts with a prefill (compute-bound, and its first call pays page faults):
    its cost per row must not decide the thread count of the decode steps that follow."""
    chooser = ThreadChooser(2)
    first = chooser.pick(50)
    chooser.record(first, 0.150, 50)  # 1.8 ms a row: dearer than either decode option below
    picks = []
    for _ in range(100):
        t = chooser.pick(8)
        chooser.record(t, {1: 0.044, 2: 0.024}[t], 8)
        picks.append(t)
    assert first == 2 and picks[:2] == [2, 1]  # decoding tries both options itself
    assert tries(picks, 1)[1:] == [2 + 8, 2 + 8 + 16, 2 + 8 + 16 + 32]  # then only the scheduled tries
    assert chooser.pick(50) == 1  # the prefill kind has not tried one thread yet
    assert chooser.used == {1: 4, 2: 97}
