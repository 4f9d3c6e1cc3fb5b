"""materl.rollout.principles: per-principle judge scores, their aggregation (mean, pareto within
a group), the critique-then-revise pass and its DPO pairs. The judge is a real tiny model, taught
(tests/rollout/taught.py) to answer the exact judge prompts with chosen scores, so every score
below is known by hand; it decodes greedily, so the same episodes always get the same scores."""

import pytest

import materl as ml
from materl.errors import ConfigError, RewardError, UnknownNameError
from materl.rollout.multiturn import EpisodeState
from materl.rollout.judge import absolute_messages, delimited
from materl.rollout.principles import CRITIQUE, PrincipleJudge, as_principles, parse_revision, preference_pairs
from materl.rollout.types import Rollout, Step
from tests.rollout.taught import teach

PRINCIPLES = [{"name": "kind", "text": "Be kind."}, {"name": "brief", "text": "Be brief.", "weight": 2.0}]
# the judge's scores, by (answer, principle)
SCORES = {("ok", "kind"): 0.75, ("ok", "brief"): 0.5, ("no", "kind"): 0.25, ("no", "brief"): 0.5}


def answer(text: str) -> Rollout:
    return Rollout(prompt_ids=[1, 2], steps=[Step("generate", [3, 4], text=text)], prompt_text="q")


def judge_messages(rubric: str, task: str, r: Rollout) -> list[dict]:  # what Judge.score asks
    return absolute_messages(rubric, task, r)


@pytest.fixture(scope="module")
def taught_judge():
    model = ml.Agent("tiny-random")
    texts = {p["name"]: p["text"] for p in PRINCIPLES}
    pairs = [(EpisodeState.start(model.tokenizer, judge_messages(texts[p], "q", answer(a))).ids, f"Score: {s}")
             for (a, p), s in SCORES.items()]
    teach(model, pairs)
    return model


async def evaluate(judge, rollouts, group_ids):
    return await judge.vector_reward().aevaluate(prompts=["q"] * len(rollouts), completions=[r.text for r in rollouts],
                                                 rollouts=rollouts, group_ids=group_ids)


async def test_each_principle_is_scored_and_weighted_then_aggregated(taught_judge):
    rollouts = [answer("ok"), answer("no")]
    mean = await evaluate(PrincipleJudge(taught_judge, PRINCIPLES, max_new_tokens=16), rollouts, [0, 1])
    # unweighted per-principle scores, as taught
    assert mean.components["kind"].tolist() == [0.75, 0.25] and mean.components["brief"].tolist() == [0.5, 0.5]
    # mean over the weighted scores: "ok" (0.75 + 2*0.5)/2 = 0.875, "no" (0.25 + 2*0.5)/2 = 0.625
    assert mean.total.tolist() == pytest.approx([0.875, 0.625])
    # a local judge at temperature 0 decodes greedily: a second judge over the same model, the same scores
    repeat = await evaluate(PrincipleJudge(taught_judge, PRINCIPLES, max_new_tokens=16), rollouts, [0, 1])
    assert {k: v.tolist() for k, v in repeat.components.items()} == {k: v.tolist() for k, v in mean.components.items()}
    pareto = await evaluate(PrincipleJudge(taught_judge, PRINCIPLES, aggregate="pareto", max_new_tokens=16),
                            rollouts, [0, 0])
    # one group: (0.75, 1.0) dominates (0.25, 1.0): ranks 0 and 1, rewards 0 and -1
    assert pareto.total.tolist() == [0.0, -1.0]
    again = await evaluate(PrincipleJudge(taught_judge, PRINCIPLES, aggregate="pareto", max_new_tokens=16),
                           rollouts, [0, 1])
    assert again.total.tolist() == [0.0, 0.0]  # each alone in its group: both on the first front


async def test_critique_then_revise_gives_a_preferred_sample():
    critic_model = ml.Agent("tiny-random")
    r = answer("no")
    messages = [{"role": "system", "content": CRITIQUE.format(principles="- Be kind.\n- Be brief.")},
                {"role": "user", "content": delimited("q", r)}]
    teach(critic_model, [(EpisodeState.start(critic_model.tokenizer, messages).ids, "Rude.\nRevision: yes, gladly")])
    judge = PrincipleJudge(critic_model, PRINCIPLES, revise="prefer", parse=lambda text: 0.5, max_new_tokens=40)
    await judge.revise_all(["q"], [r])
    assert r.metadata["revision"] == "yes, gladly"
    assert preference_pairs([r, answer("ok")]) == [{"prompt": "q", "chosen": "yes, gladly", "rejected": "no"}]


def test_principles_and_revisions_are_read_strictly():
    assert [p.name for p in as_principles(["a", {"text": "b", "name": "bee"}])] == ["p1", "bee"]
    with pytest.raises(ConfigError, match="repeated: p1"):
        as_principles(["a", {"text": "b", "name": "p1"}])
    with pytest.raises(ConfigError, match=r"principles\[0\].*unknown: txt"):
        as_principles([{"txt": "a"}])
    with pytest.raises(ConfigError, match="non-empty list"):
        as_principles("Be kind.")
    with pytest.raises(UnknownNameError, match="paretto"):
        PrincipleJudge("http://127.0.0.1:1/v1", ["a"], aggregate="paretto")
    with pytest.raises(ConfigError, match="revise must be one of None, 'score', 'prefer', got 'yes'"):
        PrincipleJudge("http://127.0.0.1:1/v1", ["a"], revise="yes")
    assert parse_revision("bad.\nRevision: draft\nrevision: final") == "final"
    with pytest.raises(RewardError, match="no 'Revision"):
        parse_revision("Looks fine to me")
