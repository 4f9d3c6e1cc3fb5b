"""How the rollout stage calls a per-episode ``@ml.op``: the node's inputs and constants bind to
the function's parameters by name, whether the scheduler calls the function itself
(``kinds/custom.py:direct_episode``, when a positional call binds the same way) or goes through
``call_episode`` (keywords)."""

from materl import op, recipe
from materl.compiler.compiled import Compiled
from materl.compiler.kinds.custom import direct_episode
from materl.compiler.options import CompileOptions


@op
async def shout(text):
    return text.upper()


@op
async def join(head, sep="-", tail=""):
    return f"{head}{sep}{tail}"


@op
async def first_only(text, /):
    return text


@recipe
def joined(prompts):
    loud = shout(prompts)
    both = join(loud, tail=prompts)  # inputs head and tail: tail is the third parameter, not the second
    return join(loud, sep="+", tail=both)  # a constant between the inputs


@recipe
def positional_only(prompts):
    return first_only(prompts)


def rollout(graph, prompts):
    compiled = Compiled(graph, {}, CompileOptions(), rollout_only=True)
    try:
        return compiled.plan, compiled.call_blocking(compiled.rollout, prompts)
    finally:
        compiled.close()


def test_inputs_and_constants_bind_by_name_on_both_paths():
    plan, episodes = rollout(joined, ["ab", "c"])
    names = [n for n in plan.episode]
    # the direct call is taken for shout only: join's inputs are not its first parameters in order
    assert [direct_episode(plan.nodes[n]) is shout.fn for n in names] == [True, False, False]
    assert [direct_episode(plan.nodes[n]) for n in names[1:]] == [None, None]
    assert [[e.values[n] for n in names] for e in episodes] == [
        ["AB", "AB-ab", "AB+AB-ab"],
        ["C", "C-c", "C+C-c"],
    ]
    assert all(e.error is None and set(e.timings) == set(names) for e in episodes)


def test_a_positional_only_parameter_still_fails_its_episode_as_a_keyword_call_does():
    plan, episodes = rollout(positional_only, ["ab"])
    (name,) = plan.episode
    assert direct_episode(plan.nodes[name]) is None
    (episode,) = episodes
    assert episode.error is not None and episode.error.kind == "TypeError" and episode.error.node == name
    assert "positional-only" in episode.error.message
