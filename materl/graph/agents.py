"""Recipe constructors for existing agent code and model judges: ``ml.agent_episodes`` (the
agent's episodes through an OpenAI-compatible endpoint served by the policy) and ``ml.judge``
(an LLM-judge reward term). Their nodes hold specs (``EndpointSpec``, ``JudgeSpec``,
``PrinciplesSpec``: frozen, picklable, checked here), never a live server or client pool: the
compiled step builds those (``materl.compiler.services``)."""

from __future__ import annotations

from materl.errors import RecipeError
from materl.graph.trace import RewardExpr, RewardTerm, Value, active_builder
from materl.rollout.judge_http import DEFAULT_MAX_ANSWER_BYTES


def agent_episodes(policy, prompts, *, agent, name: str | None = None, parser: str = "auto",
                   max_new_tokens: int | None = None, temperature: float | None = None,
                   greedy: bool | None = None, request_reward=None, model_errors=None,
                   max_request_bytes: int | None = None) -> Value:
    """Run ``agent`` (``async def my_agent(client, task) -> result``) once per episode, where
    ``client`` is an ``openai.AsyncOpenAI`` pointed at a local endpoint (127.0.0.1, one API key
    per episode) that ``policy`` serves, and ``task`` is the dataset row (``{"prompt": ...,
    **columns}``); a plain ``def my_agent(client, task)`` runs in a thread with an ``openai.OpenAI``.
    The value is the episode's Rollout: the exact token ids and sampling log-probs
    of every request, prompts and tool results untrained, the agent's return value in
    ``.metadata["result"]``. ``parser``: the tool-call format of the answers (``"auto"``: the one
    the chat template declares). ``max_new_tokens``/``temperature``: per request (default: the
    compile options'); ``greedy=True`` decodes greedily. ``request_reward``: ``fn(*, messages,
    reply, task) -> float | None`` (sync or async), called per answered request once the episode
    ends; a number is that request's step reward, on the last token it sampled (score it with
    ``ml.reward("step_rewards", rollout=...)``). ``model_errors``: the exceptions that are the
    model's mistake, so an episode ending in one is scored (no result) instead of failed (default
    ``materl.rollout.agent_errors.MODEL_ERRORS``, common frameworks' model-behaviour errors; ``()``
    fails on every exception); classes or qualified names. ``max_request_bytes``: the endpoint's
    body limit (default 8 MiB). See ``materl.compiler.kinds.agents``."""
    if not callable(agent):
        raise RecipeError(f"ml.agent_episodes(agent=...) needs a function (client, task) -> result (async def, or "
                          f"a plain def run in a thread), got {agent!r}")
    if request_reward is not None and not callable(request_reward):
        raise RecipeError(f"ml.agent_episodes(request_reward=...) needs a function (messages, reply, task) -> "
                          f"float | None, got {request_reward!r}")
    from materl.rollout.agent_errors import check_model_errors
    from materl.rollout.endpoint import EndpointSpec

    if model_errors is not None:
        model_errors = check_model_errors(model_errors, "ml.agent_episodes")
    if max_request_bytes is not None and (not isinstance(max_request_bytes, int) or max_request_bytes < 1):
        raise RecipeError(f"ml.agent_episodes(max_request_bytes=...) takes a positive int, got {max_request_bytes!r}")
    b = active_builder("ml.agent_episodes")
    a = b.agent(policy, "ml.agent_episodes")
    endpoint = EndpointSpec(**({"max_request_bytes": max_request_bytes} if max_request_bytes else {}))
    params = {"agent": agent, "endpoint": endpoint, "parser": parser,
              **{k: v for k, v in (("max_new_tokens", max_new_tokens), ("temperature", temperature),
                                   ("greedy", greedy), ("request_reward", request_reward),
                                   ("model_errors", model_errors))
                 if v is not None}}
    return b.add("agent_episodes", [a, prompts], params, scope="episode", name=name, default_name="rollout",
                 fixed_scope=True)


def judge(rubric: str | None = None, *, model, rollout=None, relative: bool = False, weight: float = 1.0,
          name: str | None = None, parse=None, api_key: str | None = None, model_name: str = "judge",
          max_concurrency: int = 8, timeout_s: float = 60.0, retries: int = 2, max_new_tokens: int = 256,
          temperature: float = 0.0, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES, backoff_s: float = 1.0,
          max_backoff_s: float = 60.0, principles=None, aggregate: str = "mean",
          revise: str | None = None) -> RewardExpr:
    """A reward term scored by an LLM judge against ``rubric``: ``model`` is a materl ``Agent``
    (in process) or an OpenAI-compatible base URL (``model_name``/``api_key`` for its requests).
    Each episode's rollout (default: the recipe's latest) is judged as soon as it exists, while
    other episodes still generate; ``relative=True`` judges a group's episodes in one call,
    scored against each other (ART's RULER). ``parse``: ``text -> float`` (``text, n ->
    list[float]`` when relative) instead of reading ``Score: x`` lines. Calls are bounded by
    ``max_concurrency``, each attempt by ``timeout_s``, a URL judge's answer by
    ``max_answer_bytes``; failed calls are retried ``retries`` times after a jittered backoff
    from ``backoff_s`` doubling to ``max_backoff_s`` (or the server's ``Retry-After``, up to
    ``max_backoff_s``); a judge that still fails or answers unparseably fails the episode with
    its error. Compose with ``+``:
    ``ml.judge(...) + ml.reward(exact_answer)``. See ``materl.rollout.judge``.

    ``principles=[...]`` instead of a rubric: one judge call per principle (strings, or dicts with
    ``text``, ``name``, ``weight``), each principle's score an episode metric
    ``reward/<name>/<principle>``, the reward their ``aggregate`` (a ``REWARD_AGGREGATORS`` name:
    mean, weighted_sum, min, max, or pareto within the group); ``revise="score"`` or ``"prefer"``
    adds a critique-then-revise pass (``materl.rollout.principles``)."""
    from materl.rollout.judge import JudgeSpec

    if principles is not None:
        return _principles(rubric, principles, model=model, rollout=rollout, relative=relative, weight=weight,
                           name=name, aggregate=aggregate, revise=revise,
                           options=dict(parse=parse, api_key=api_key, model_name=model_name,
                                        max_concurrency=max_concurrency, timeout_s=timeout_s, retries=retries,
                                        max_new_tokens=max_new_tokens, temperature=temperature,
                                        max_answer_bytes=max_answer_bytes, backoff_s=backoff_s,
                                        max_backoff_s=max_backoff_s))
    if aggregate != "mean" or revise is not None:
        raise RecipeError(f"ml.judge(aggregate={aggregate!r}, revise={revise!r}) apply to principles=[...]; this "
                          f"judge has a rubric and no principles")

    if not isinstance(rubric, str) or not rubric.strip():
        raise RecipeError(f"ml.judge needs a rubric (a non-empty string), got {rubric!r}")
    if rollout is not None and not isinstance(rollout, Value):
        raise RecipeError(f"ml.judge(rollout=...) needs a Value from the recipe, got {rollout!r}")
    the_judge = JudgeSpec(model, rubric, api_key=api_key, model_name=model_name, parse=parse,
                      max_concurrency=max_concurrency, timeout_s=timeout_s, retries=retries,
                      max_new_tokens=max_new_tokens, temperature=temperature, max_answer_bytes=max_answer_bytes,
                      backoff_s=backoff_s, max_backoff_s=max_backoff_s)
    b = active_builder("ml.judge")
    scored = rollout if rollout is not None else b.latest_completions("ml.judge")
    if scored is None:
        raise RecipeError(f"ml.judge in recipe {b.name!r} has nothing to judge: no rollout comes before it")
    params = {"judge": the_judge, **({"relative": True} if relative else {})}
    value = b.add("judge", [scored], params, scope="group" if relative else "episode", name=name,
                  default_name="judge", fixed_scope=True)
    return RewardExpr((RewardTerm(value, float(weight), name=name or value.node),))


def _principles(rubric, principles, *, model, rollout, relative: bool, weight: float, name: str | None,
                aggregate: str, revise: str | None, options: dict) -> RewardExpr:
    from materl.rollout.principles import PrinciplesSpec

    if rubric is not None or relative:
        raise RecipeError(f"ml.judge(principles=...) scores each principle on its own; drop "
                          f"{'the rubric ' + repr(rubric) if rubric is not None else 'relative=True'} "
                          f"(a rubric is a principle: put it in the list)")
    if rollout is not None and not isinstance(rollout, Value):
        raise RecipeError(f"ml.judge(rollout=...) needs a Value from the recipe, got {rollout!r}")
    the_judge = PrinciplesSpec(model, principles, aggregate, revise, options)
    b = active_builder("ml.judge")
    scored = rollout if rollout is not None else b.latest_completions("ml.judge")
    if scored is None:
        raise RecipeError(f"ml.judge in recipe {b.name!r} has nothing to judge: no rollout comes before it")
    value = b.add("principles", [scored], {"principles": the_judge},
                  scope="group" if the_judge.group_wise else "episode", name=name, default_name="principles",
                  fixed_scope=True)
    return RewardExpr((RewardTerm(value, float(weight), name=name or value.node),))
