"""The curriculum: level moves by hand-counted pass rates, band filtering, the staleness rule,
and a real run whose resume is bit-identical (weights, level, metrics) to an unbroken one.

``Levels`` is a dataset of this test's own that declares knobs (the ``Knobbed`` protocol, which
any dataset may implement): level L asks for L + 1 words, so it shows that the curriculum is not
tied to reasoning-gym."""

import pytest
import torch

import materl as ml
from materl.compiler.episode import Episode
from materl.errors import ConfigError
from materl.recipes import grpo
from materl.runtime.curriculum import INDEX, LEVEL, Curriculum, CurriculumSampler, Knobbed
from materl.runtime.logging import plot_series, read_metrics
from materl.runtime.train import train


class Levels:
    levels = 3
    score_key = "reward/even_sum"

    def rows_at(self, level, n, *, seed):
        return [{"prompt": f"Say {level + 1} words about item {seed}-{i}."} for i in range(n)]

    def __repr__(self):
        return "Levels()"


def even_sum(*, completion_ids, **_):
    """1 when the completion's token ids sum to an even number: about half pass, by chance."""
    return [float(sum(ids) % 2 == 0) for ids in completion_ids]


def episodes(rows, passed, group_size=1):
    """Real Episode records for ``rows`` (each repeated ``group_size`` times), scored ``passed``."""
    out = []
    for g, row in enumerate(rows):
        for j in range(group_size):
            i = g * group_size + j
            out.append(Episode(i, g, g, row["prompt"], {k: v for k, v in row.items() if k != "prompt"}, seed=0,
                               metrics={"reward/even_sum": float(passed[i])}))
    return out


def test_levels_is_knobbed_and_a_plain_list_is_not():
    assert isinstance(Levels(), Knobbed) and isinstance(ml.ReasoningGymTask("basic_arithmetic"), Knobbed)
    with pytest.raises(ConfigError, match="declares difficulty knobs.*got list"):
        CurriculumSampler([{"prompt": "x"}], Curriculum(), batch_size=1)
    with pytest.raises(ConfigError, match=r"start_level=3; Levels\(\) has levels 0..2"):
        CurriculumSampler(Levels(), Curriculum(start_level=3), batch_size=1)
    with pytest.raises(ConfigError, match="lower_below=0.9, raise_above=0.8"):
        Curriculum(lower_below=0.9)
    with pytest.raises(ConfigError, match=r"band=\(0.5, 0.2\)"):
        Curriculum(band=(0.5, 0.2))


def test_a_knobbed_dataset_without_a_curriculum_is_a_clear_error(tmp_path):
    step = _step()
    try:
        with pytest.raises(ConfigError, match=r"Levels\(\) is a dataset with difficulty knobs.*curriculum="):
            train(step, Levels(), steps=1, run_dir=tmp_path, progress=False)
    finally:
        step.close()


def test_raise_when_the_window_passes_and_lower_when_it_falls():
    s = CurriculumSampler(Levels(), Curriculum(raise_above=0.75, lower_below=0.25, window=4, pool_size=8),
                          batch_size=2)
    b0 = s.next_batch()
    assert [r[LEVEL] for r in b0] == [0, 0] and all("1 words" in r["prompt"] for r in b0)
    s.observe(0, episodes(b0, [1, 1, 1, 0], group_size=2))  # 3 of 4 passed: 0.75 >= 0.75
    assert s.metrics(0)["curriculum/pass_rate"] == 0.75
    b1 = s.next_batch()  # applies step 0: the window (4 episodes) is full at 0.75 -> level 1
    assert s.level == 1 and [r[LEVEL] for r in b1] == [1, 1] and s.window == []
    s.observe(1, episodes(b1, [0, 1, 0, 0], group_size=2))  # 1 of 4: 0.25 is not < 0.25
    s.next_batch()
    assert s.level == 1 and s.window == [1.0, 0.0, 0.0, 0.0]  # group pass counts, window of 4
    s.observe(2, episodes(s._pools[1][:2], [0, 0, 0, 0], group_size=2))
    s.next_batch()
    assert s.level == 0  # window 0/4 < 0.25 -> lowered
    m = s.metrics(2)
    assert m["curriculum/level"] == 1.0 and m["curriculum/next_level"] == 0.0


def test_outcomes_apply_with_the_staleness_lag():
    """With max_staleness=1, batch j sees steps up to j - 2 only."""
    s = CurriculumSampler(Levels(), Curriculum(raise_above=0.5, window=2, pool_size=8), batch_size=2,
                          max_staleness=1)
    b0, b1 = s.next_batch(), s.next_batch()
    s.observe(0, episodes(b0, [1, 1]))
    b2 = s.next_batch()  # step 0 applied (2/2 passed) -> level 1
    assert [r[LEVEL] for r in b1] == [0, 0] and [r[LEVEL] for r in b2] == [1, 1]
    s.observe(1, episodes(b1, [1, 1]))  # drawn at level 0 before the move: not in the level-1 window
    s.next_batch()
    assert s.level == 1 and s.window == []


def test_band_skips_prompts_whose_pass_rate_is_outside_it():
    s = CurriculumSampler(Levels(), Curriculum(band=(0.25, 0.75), window=100, pool_size=4), batch_size=4)
    first = s.next_batch()  # one epoch: every prompt once, none seen before
    assert sorted(r[INDEX] for r in first) == [0, 1, 2, 3]
    rates = {0: [1, 1], 1: [0, 0], 2: [1, 0], 3: [0, 1]}  # prompts 0 (rate 1) and 1 (rate 0) leave the band
    rows = sorted(first, key=lambda r: r[INDEX])
    s.observe(0, episodes(rows, [x for i in range(4) for x in rates[i]], group_size=2))
    second = s.next_batch()
    assert sorted(r[INDEX] for r in second) == [2, 2, 3, 3]
    assert s.rates == {"0:0": 1.0, "0:1": 0.0, "0:2": 0.5, "0:3": 0.5}


def test_a_missing_score_metric_names_what_the_episode_has():
    s = CurriculumSampler(Levels(), Curriculum(), batch_size=1)
    ep = episodes(s.next_batch(), [1])[0]
    ep.metrics = {"reward/length": 1.0}
    with pytest.raises(ConfigError, match=r"'reward/even_sum'.*reward/length"):
        s.observe(0, [ep])


def _step():
    recipe = ml.replace(grpo, "rewards", lambda g: ml.reward(even_sum))
    return ml.compile(recipe, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                      group_size=2, max_new_tokens=5, lr=1e-3, temperature=1.0, seed=0)


def _train(run_dir, steps, **kw):
    step = _step()
    try:
        result = train(step, Levels(), steps=steps, batch_size=2, save_every=1, run_dir=run_dir, progress=False,
                       tensorboard=False, seed=3,
                       curriculum=Curriculum(raise_above=0.6, lower_below=0.4, window=4, pool_size=6), **kw)
    finally:
        step.close()
    return result, [p.detach().clone() for p in step.agents["policy"].parameters()]


def test_resume_is_bit_identical_with_the_curriculum_moving(tmp_path):
    full, w_full = _train(tmp_path / "full", 8)
    _train(tmp_path / "half", 3)
    resumed, w_resumed = _train(tmp_path / "half", 8, resume=tmp_path / "half")
    keys = ("loss", "reward", "curriculum/level", "curriculum/pass_rate", "curriculum/window_pass_rate",
            "curriculum/next_level")
    levels = [h["curriculum/level"] for h in full["history"]]
    assert len(set(levels)) > 1, levels  # the level moved during the run (else the test shows nothing)
    assert [[h[k] for k in keys] for h in full["history"][3:]] == [[h[k] for k in keys] for h in resumed["history"]]
    assert all(torch.equal(a, b) for a, b in zip(w_full, w_resumed))
    panels = dict(plot_series(read_metrics(tmp_path / "full" / "metrics.jsonl")))
    assert [k for k, *_ in panels["curriculum level"]] == ["curriculum/level"]
    assert [k for k, *_ in panels["curriculum pass rate"]] == ["curriculum/pass_rate", "curriculum/window_pass_rate"]
    assert (tmp_path / "full" / "plot.png").exists()


def test_resume_is_bit_identical_under_the_asynchronous_pipeline(tmp_path):
    """max_staleness=1, deterministic: batch j sees steps up to j - 2, and a checkpoint keeps the
    outcomes recorded after the next batch was drawn."""
    def step():
        recipe = ml.replace(grpo, "rewards", lambda g: ml.reward(even_sum))
        return ml.compile(recipe, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                          group_size=2, max_new_tokens=5, lr=1e-3, temperature=1.0, seed=0, max_staleness=1,
                          deterministic=True)

    def run(run_dir, steps, **kw):
        s = step()
        try:
            result = train(s, Levels(), steps=steps, batch_size=2, save_every=1, run_dir=run_dir, progress=False,
                           tensorboard=False, seed=3,
                           curriculum=Curriculum(raise_above=0.6, lower_below=0.4, window=4, pool_size=6), **kw)
        finally:
            s.close()
        return result, [p.detach().clone() for p in s.agents["policy"].parameters()]

    full, w_full = run(tmp_path / "full", 7)
    run(tmp_path / "half", 3)
    resumed, w_resumed = run(tmp_path / "half", 7, resume=tmp_path / "half")
    keys = ("loss", "curriculum/level", "curriculum/pass_rate", "curriculum/window_pass_rate", "curriculum/next_level")
    assert len({h["curriculum/level"] for h in full["history"]}) > 1
    assert [[h[k] for k in keys] for h in full["history"][3:]] == [[h[k] for k in keys] for h in resumed["history"]]
    assert all(torch.equal(a, b) for a, b in zip(w_full, w_resumed))
