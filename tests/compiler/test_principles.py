"""ml.judge(principles=[...]) in a compiled recipe, against a real HTTP judge: the rule judge of
examples/constitutional_rl.py served on 127.0.0.1 (it applies each principle literally, so every
score is computed here by hand from the episode's answer). Also: examples/constitutional_rl.py
runs two steps on the tiny model (CI)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import materl as ml
from materl.errors import RecipeError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from constitutional_rl import PRINCIPLES, rule_judge_url  # noqa: E402


@pytest.fixture(scope="module")
def judge_url():
    return rule_judge_url()


def brief(text: str) -> float:
    return min(1.0, 12 / max(1, len(text.split())))


def polite(text: str) -> float:
    return float(bool(re.search(r"please|thank", text, re.I)))


def judged(url, **kw):
    @ml.recipe
    def principled(policy, prompts):
        completions = ml.generate(policy, prompts, name="completions")
        rewards = ml.judge(principles=PRINCIPLES, model=url, name="principles", **kw)
        ml.set_loss(ml.reinforce_loss(ml.advantages(rewards, name="advantages"),
                                      ml.logprobs(policy, prompts, completions)))
    return principled


def run(recipe, prompts=("hi", "yo"), **options):
    step = ml.compile(recipe, policy=ml.Agent("tiny-random", trainable=True), group_size=3, max_new_tokens=24,
                      seed=0, temperature=1.0, **options)
    try:
        return step.run(list(prompts)), step.last_episodes
    finally:
        step.close()


def test_each_principle_is_a_metric_and_the_reward_their_mean(judge_url):
    recipe = judged(judge_url)
    assert str(recipe.node("principles")) == ("%principles = principles(%completions) "
                                              "{principles=PrincipleJudge(brief, polite; aggregate='mean')} [episode]")
    metrics, eps = run(recipe)
    texts = [ep.values["completions"].text for ep in eps]
    b, p = torch.tensor([brief(t) for t in texts]), torch.tensor([polite(t) for t in texts])
    assert metrics["reward/principles/brief/mean"] == pytest.approx(float(b.mean()), abs=1e-6)
    assert metrics["reward/principles/polite/mean"] == pytest.approx(float(p.mean()), abs=1e-6)
    assert [ep.values["principles"] for ep in eps] == pytest.approx(((b + p) / 2).tolist(), abs=1e-6)
    assert metrics["reward"] == pytest.approx(float(((b + p) / 2).mean()), abs=1e-6)


def test_pareto_ranks_each_group_on_the_principle_vector(judge_url):
    recipe = judged(judge_url, aggregate="pareto")
    assert recipe.node("principles").scope == "group"
    _, eps = run(recipe)
    for g in {ep.group for ep in eps}:
        members = [ep for ep in eps if ep.group == g]
        vec = [(brief(ep.values["completions"].text), polite(ep.values["completions"].text)) for ep in members]
        # rank by hand: a vector dominated by none of the group's is on front 0; then remove and repeat
        left, rank, level = set(range(len(vec))), {}, 0
        while left:
            front = {i for i in left if not any(all(x >= y for x, y in zip(vec[j], vec[i])) and vec[j] != vec[i]
                                                for j in left)}
            rank.update({i: level for i in front})
            left -= front
            level += 1
        assert [ep.values["principles"] for ep in members] == [-float(rank[i]) for i in range(len(members))]


def test_revise_keeps_the_revision_and_scores_with_it_as_reference(judge_url):
    _, eps = run(judged(judge_url, revise="score"), prompts=("hi",))
    for ep in eps:
        r = ep.values["completions"]
        assert r.metadata["revision"] == (" ".join(r.text.split()[:12]) + " Thanks!").strip()
        # the reference is shown to the judge, which (by its rule) grades the answer itself
        assert ep.values["principles"] == pytest.approx((brief(r.text) + polite(r.text)) / 2, abs=1e-6)


def test_bad_principle_settings_are_recipe_time_errors(judge_url):
    with pytest.raises(RecipeError, match="drop the rubric 'Be nice.'"):
        @ml.recipe
        def both(policy, prompts):
            ml.generate(policy, prompts)
            ml.judge("Be nice.", principles=["Be brief."], model=judge_url)
    with pytest.raises(RecipeError, match=r"aggregate='min', revise=None\) apply to principles"):
        @ml.recipe
        def rubric_only(policy, prompts):
            ml.generate(policy, prompts)
            ml.judge("Be nice.", aggregate="min", model=judge_url)


def test_the_example_trains_two_steps_on_the_tiny_model():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "examples/constitutional_rl.py", "--tiny"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["0", "1"], out.stdout
    # no episode failed, and every episode's answer was revised into a preferred sample (8 pairs a step)
    assert all("failed 0" in line and "pairs 8" in line for line in lines), out.stdout


def test_dpo_trains_on_revisions_longer_than_the_answers():
    """Preference pairs from revisions have chosen and rejected of different lengths; the frozen
    reference's log-probs are then stored at the batch's widest row and must be cut back to each
    side's own width (a ShapeError before)."""
    from materl.recipes import dpo

    pairs = [{"prompt": "q", "chosen": "a much longer and kinder answer, thanks!", "rejected": "no"},
             {"prompt": "r", "chosen": "yes", "rejected": "a long rude reply that goes on"}]
    step = ml.compile(dpo, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                      lr=3e-3)
    try:
        first = step.run(pairs=pairs)
        for _ in range(4):
            last = step.run(pairs=pairs)
    finally:
        step.close()
    # at the start policy = reference: every margin 0, loss log 2
    assert first["dpo_loss/accuracy"] == 0.0 and first["loss"] == pytest.approx(0.6931472, abs=1e-5)
    assert last["dpo_loss/accuracy"] == 1.0 and last["loss"] < 0.2
