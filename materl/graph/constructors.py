"""Node constructors: what a recipe body calls. Each adds one node and returns its Value.

Hyperparameters left as ``None`` are filled at compile time from the compile options (e.g.
``max_new_tokens``); everything else is recorded on the node and shown by ``print(recipe)``.
"""

from __future__ import annotations

import warnings
from typing import Any

from materl.errors import ConfigError, RecipeError, RecipeWarning
from materl.graph.trace import RewardExpr, RewardTerm, Value, active_builder
from materl.ops.advantages import ADVANTAGES
from materl.ops.aggregate import LOSS_AGG
from materl.ops.kl import ESTIMATOR_DEFAULT, KL_ALIASES, KL_ESTIMATORS
from materl.ops.losses import POLICY_LOSSES
from materl.ops.preference import PREFERENCE_LOSSES
from materl.ops.rewards import REWARDS
from materl.ops.step_credit import GRPO_FAMILY, STEP_CREDIT
from materl.ops.turn_credit import check_turn_hparams


def _given(**kw: Any) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if v is not None}


def _check_tools(tools: Any, what: str, *, schemas_ok: bool) -> None:
    """``tools=`` is a Toolbox (``ml.mcp_tools(...)``); generate_step also takes OpenAI function
    specs (dicts) or None. A server command line is not a Toolbox."""
    from materl.rollout.mcp import Toolbox

    if (tools is None and schemas_ok) or isinstance(tools, Toolbox):
        return
    if schemas_ok and isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools):
        return
    example = ""
    if isinstance(tools, str) or (isinstance(tools, (list, tuple)) and tools and all(isinstance(t, str) for t in tools)):
        servers = [tools] if isinstance(tools, str) else list(tools)
        example = f"; write tools=ml.mcp_tools({', '.join(repr(t) for t in servers)})"
    accepted = "a Toolbox (ml.mcp_tools(...)), OpenAI function specs or None" if schemas_ok else \
        "a Toolbox (ml.mcp_tools(...))"
    raise RecipeError(f"{what}(tools=...) takes {accepted}, got {tools!r}{example}")


# -- rollout (episode scope) ------------------------------------------------------------------


def generate(agent, prompts, *, name: str | None = None, max_new_tokens: int | None = None,
             temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
             system: str | None = None, stop: list[str] | None = None, greedy: bool | None = None) -> Value:
    """Sample one completion per episode from ``agent`` (a single-turn Rollout); ``greedy=True``
    decodes greedily (ReMax's baseline)."""
    b = active_builder("ml.generate")
    a = b.agent(agent, "ml.generate")
    params = _given(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                    system=system, stop=stop, greedy=greedy)
    return b.add("generate", [a, prompts], params, scope="episode", name=name,
                 default_name="completions", fixed_scope=True)


def generate_step(agent, history, tool_responses=None, *, name: str | None = None, tools=None,
                  parser: str = "auto", max_new_tokens: int | None = None,
                  temperature: float | None = None, system: str | None = None,
                  parallel_tool_calls: bool = True) -> Value:
    """Continue an episode: append ``tool_responses`` to ``history`` (the prompts for the first
    turn, else a previous step's ``.history``) and generate until end of turn (with
    ``parallel_tool_calls=False``: or the end of the first tool call; see
    ``materl.rollout.multiturn.model_turn``). ``parser``: the tool-call format (``"auto"``: the one
    the model's chat template declares; see ``materl.rollout.parsers``). The result has
    ``.tool_requests`` (every call of the turn, in order), ``.history``, ``.text``, ``.token_ids``,
    ``.logprobs``."""
    if not isinstance(parallel_tool_calls, bool):
        raise RecipeError(f"ml.generate_step: parallel_tool_calls must be True or False, got {parallel_tool_calls!r}")
    _check_tools(tools, "ml.generate_step", schemas_ok=True)
    b = active_builder("ml.generate_step")
    a = b.agent(agent, "ml.generate_step")
    inputs = [a, history] + ([tool_responses] if tool_responses is not None else [])
    params = _given(tools=tools, max_new_tokens=max_new_tokens, temperature=temperature, system=system)
    params["parser"] = parser
    if not parallel_tool_calls:
        params["parallel_tool_calls"] = False
    return b.add("generate_step", inputs, params, scope="episode", name=name, default_name="step",
                 fixed_scope=True)


def env_rollout(agent, env, prompts, *, max_turns: int | None = None, name: str | None = None) -> Value:
    """A multi-turn episode against an environment: one fresh ``env()`` per episode (any object
    with async ``reset(prompt, **columns)``, async ``step(text) -> EnvStep`` and ``is_done()``,
    see ``materl.rollout.env``), driven for up to ``max_turns`` model turns (default: the compile
    option). The environment's turns are untrained; its step rewards land on the model turn they
    judge (score them with ``ml.reward("step_rewards")``)."""
    if not callable(env):
        raise RecipeError(f"ml.env_rollout needs an environment factory (a class or a function returning a "
                          f"fresh environment), got {env!r}")
    b = active_builder("ml.env_rollout")
    a = b.agent(agent, "ml.env_rollout")
    params = {"env": env, **({"max_turns": max_turns} if max_turns else {})}
    return b.add("env_rollout", [a, prompts], params, scope="episode", name=name, default_name="rollout",
                 fixed_scope=True)


def structure_rollout(*parts, name: str | None = None, turn_gamma: float | None = None) -> Value:
    """The episode's Rollout: ordered generate and tool steps with exact token ids and loss masks
    (tool output and prompts are never trained on)."""
    if not parts:
        raise RecipeError("ml.structure_rollout needs at least one step")
    b = active_builder("ml.structure_rollout")
    return b.add("structure_rollout", list(parts), _given(turn_gamma=turn_gamma), scope="episode",
                 name=name, default_name="rollout", fixed_scope=True)


def reward(fn, *, weight: float = 1.0, rollout=None, step=None, name: str = "", **params) -> RewardExpr:
    """A weighted reward term: a registered name (``"length"``) or a callable
    ``fn(*, completions, prompts, completion_ids, rollouts, **columns)``. ``+`` composes; the sum
    becomes one ``rewards`` node. ``rollout=`` picks what it scores (default: the latest generated
    output); ``step=`` scores one generate step and puts the reward on that step's last token."""
    if isinstance(fn, str):

        REWARDS.get(fn)  # unknown names fail here, at recipe time, with a suggestion
    elif not callable(fn):
        raise RecipeError(f"ml.reward needs a reward name or a callable, got {fn!r}")
    for key, v in (("rollout", rollout), ("step", step)):
        if v is not None and not isinstance(v, Value):
            raise RecipeError(f"ml.reward({key}=...) needs a Value from the recipe, got {v!r}")
    term = RewardTerm(fn, float(weight), tuple(sorted(params.items())),
                      rollout.ref if rollout is not None else None, step.ref if step is not None else None, name)
    return RewardExpr((term,))


def filter_groups(rewards, *, metric: str = "reward", name: str | None = None) -> Value:
    """DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage signal)."""
    b = active_builder("ml.filter_groups")
    return b.add("filter_groups", [rewards], {"metric": metric}, scope="group", name=name,
                 default_name="filter_groups")


# -- group scope -------------------------------------------------------------------------------


def advantages(rewards, ref_logprobs=None, policy_logprobs=None, *, estimator: str | None = None,
               kl_coef: float = 0.0, kl: str = "k1", baseline=None, completions=None, step_credit: str | None = None,
               name: str | None = None, **hparams) -> Value:
    """Advantages from rewards with a registered estimator (default: the recipe's, else grpo).

    ``step_credit`` decides how step rewards (any ``ml.reward(..., step=...)`` term) are credited
    under a GRPO-family estimator (grpo, dr_grpo): ``"process"`` (the default with step rewards:
    DeepSeekMath's process supervision, ``materl.ops.step_credit``) or ``"sum"`` (verl: the
    row's summed reward on every token). Outcome-only rewards are always verl's GRPO. Turn-level
    and GiGPO credit are estimators of their own (``turn_grpo``, ``gigpo``), written
    ``ml.turn_advantages``, ``ml.gigpo_advantages``.

    ``ref_logprobs``/``policy_logprobs`` are read only with ``kl_coef > 0``: the rewards then get a
    per-token KL penalty ``-kl_coef * KL(policy_old || ref)`` first (verl's ``use_kl_in_reward``),
    which makes the node batch-scope. With ``kl_coef == 0`` they are not dependencies.
    ``baseline`` is the baseline reward of estimators that take one (ReMax's greedy rollout).
    ``completions`` gives the token mask; default: the latest generated output."""
    b = active_builder("ml.advantages")
    if estimator is not None:

        ADVANTAGES.get(estimator)
    if step_credit is not None and step_credit not in STEP_CREDIT:
        raise RecipeError(f"ml.advantages(step_credit={step_credit!r}) in recipe {b.name!r}: valid: "
                          f"{', '.join(STEP_CREDIT)} (turn-level and GiGPO credit: ml.turn_advantages, "
                          f"ml.gigpo_advantages)")
    if step_credit is not None and estimator is not None and estimator not in GRPO_FAMILY:
        raise RecipeError(f"ml.advantages(step_credit={step_credit!r}) applies to the GRPO family "
                          f"({', '.join(GRPO_FAMILY)}); estimator {estimator!r} sums step rewards like verl")
    scored = completions if completions is not None else _scored(b, "ml.advantages")
    inputs = [rewards, scored] + ([baseline] if baseline is not None else [])
    if kl_coef:
        if ref_logprobs is None or policy_logprobs is None:
            raise RecipeError("ml.advantages(kl_coef>0) needs ref_logprobs and policy_logprobs")
        inputs += [ref_logprobs, policy_logprobs]
    elif ref_logprobs is not None or policy_logprobs is not None:
        warnings.warn(RecipeWarning(
            f"ml.advantages in recipe {b.name!r}: ref_logprobs/policy_logprobs are read only with kl_coef > 0 "
            f"(a KL penalty in the reward); they are not inputs here. Drop them, or pass kl_coef= for the "
            f"penalty (a KL term in the loss is the policy loss's kl_coef)"), stacklevel=2)
    params = {"estimator": estimator, **hparams, **({"kl_coef": kl_coef, "kl": kl} if kl_coef else {}),
              **_given(step_credit=step_credit)}
    return b.add("advantages", inputs, _given(**params), scope="group", name=name, default_name="advantages")


def gae_advantages(rewards, values, *, gamma: float = 1.0, lam: float = 1.0, name: str | None = None) -> Value:
    """Generalised advantage estimation over a value model (PPO/VAPO); also yields returns."""
    b = active_builder("ml.gae_advantages")
    return b.add("advantages", [rewards, _scored(b, "ml.gae_advantages"), values],
                 {"estimator": "gae", "gamma": gamma, "lam": lam}, scope="group", name=name,
                 default_name="gae_advantages")


def turn_advantages(rewards, rollout, *, gamma: float = 1.0, eps: float = 1e-6, name: str | None = None) -> Value:
    """Turn-level GRPO advantages (and ``.returns``) of ``rollout``: turn j's return against turn j's
    returns in the group (``materl.ops.turn_credit.turn_grpo``, MT-GRPO's credit assignment)."""
    check_turn_hparams("turn_advantages", gamma=gamma, eps=eps)
    b = active_builder("ml.turn_advantages")
    return b.add("advantages", [rewards, rollout], {"estimator": "turn_grpo", "gamma": float(gamma), "eps": float(eps)},
                 scope="group", name=name, default_name="turn_advantages")


def gigpo_advantages(rewards, rollout, *, omega: float = 1.0, gamma: float = 0.95, norm: str = "std",
                     eps: float = 1e-6, anchor=None, name: str | None = None) -> Value:
    """GiGPO advantages (and ``.returns``) of ``rollout`` (``materl.ops.turn_credit.gigpo``):
    the episode-level group advantage plus ``omega`` times a step-level one over the group's turns
    taken from the same anchor state. ``anchor(rollout, turn) -> hashable`` names a turn's state
    (default: ``materl.compiler.turns.observation_anchor``)."""
    check_turn_hparams("gigpo_advantages", gamma=gamma, eps=eps, omega=omega, norm=norm)
    if anchor is not None and not callable(anchor):
        raise ConfigError(f"gigpo_advantages(anchor=...) takes a function (rollout, turn) -> hashable, got {anchor!r}")
    params = {"estimator": "gigpo", "omega": float(omega), "gamma": float(gamma), "norm": norm, "eps": float(eps),
              **_given(anchor=anchor)}
    b = active_builder("ml.gigpo_advantages")
    return b.add("advantages", [rewards, rollout], params, scope="group", name=name, default_name="gigpo_advantages")


def _scored(b, what: str) -> Value:
    latest = b.latest_completions(what)
    if latest is None:
        raise RecipeError(f"{what} needs generated completions earlier in recipe {b.name!r}")
    return latest


# -- learner (batch scope) ---------------------------------------------------------------------


def logprobs(agent, prompts, completions, *, name: str | None = None, temperature: float | None = None,
             recompute: bool = False) -> Value:
    """Per-token log-probs of ``completions`` under ``agent`` (B,T), computed in chunks.

    For a trainable agent the policy losses' old log-probs are the engine's sampling log-probs;
    ``recompute=True`` makes them a no-gradient forward by the learner under the weights at the
    start of the step (the proximal policy of off-policy corrections: one more forward per step).
    Either way the engine-vs-learner mismatch is reported as ``mismatch/*``. A frozen agent's
    log-probs are always computed by the learner."""
    if not isinstance(recompute, bool):
        raise RecipeError(f"ml.logprobs(recompute=...) takes True or False, got {recompute!r}")
    b = active_builder("ml.logprobs")
    a = b.agent(agent, "ml.logprobs")
    params = {**_given(temperature=temperature), **({"recompute": True} if recompute else {})}
    return b.add("logprobs", [a, prompts, completions], params, scope="batch", name=name, default_name="logprobs")


def values(agent, prompts, completions, *, name: str | None = None) -> Value:
    """Per-token values (B,T) from an agent with ``head="value"``."""
    b = active_builder("ml.values")
    a = b.agent(agent, "ml.values")
    return b.add("values", [a, prompts, completions], {}, scope="batch", name=name, default_name="values")


def policy_loss(advantages, logprobs, ref_logprobs=None, *, loss: str = "ppo_clip", agg: str = "token_mean",
                kl: str | None = None, kl_coef: float = 0.0, kl_clamp: float | None = ESTIMATOR_DEFAULT,
                kl_bias_correction: bool = False, name: str | None = None, **hparams) -> Value:
    """A registered policy loss, aggregated by a registered mode, plus ``kl_coef * agg(KL)`` when
    reference log-probs are given. Old log-probs are those ``logprobs`` prepares: the rollout's
    sampling log-probs, or the recomputed ones (``ml.logprobs(..., recompute=True)``).

    ``kl_clamp``: the KL estimate is clipped to [-kl_clamp, kl_clamp]; omitted, the estimator's
    default (10 for k3, verl's low_var_kl; none for the others); None: no clamp (TRL).
    ``kl_bias_correction=True``: the per-token KL is multiplied by the importance ratio pi/pi_old,
    with its gradient (TRL 1.16's default ``use_bias_correction_kl``; ``materl.ops.kl.bias_corrected_kl``).
    TRL GRPOTrainer's KL term is ``kl="k3", kl_clamp=None, kl_bias_correction=True``."""
    POLICY_LOSSES.get(loss)
    LOSS_AGG.get(agg)
    if kl_coef and ref_logprobs is None:
        raise RecipeError(f"policy loss {loss!r} has kl_coef={kl_coef} but no ref_logprobs")
    if kl is not None:

        KL_ESTIMATORS.get(KL_ALIASES.get(kl, kl))
    kl_params = _kl_settings(f"policy loss {loss!r}", kl_clamp, kl_bias_correction)
    if kl_params and ref_logprobs is None:
        raise RecipeError(f"policy loss {loss!r} has {', '.join(f'{k}={v!r}' for k, v in kl_params.items())} "
                          f"but no ref_logprobs (they set the KL term, which needs reference log-probs)")
    b = active_builder("ml.policy_loss")
    inputs = [advantages, logprobs] + ([ref_logprobs] if ref_logprobs is not None else [])
    params = {"loss": loss, "agg": agg, **hparams}
    if ref_logprobs is not None:
        params.update(kl=kl or "k3", kl_coef=float(kl_coef), **kl_params)
    return b.add("policy_loss", inputs, params, scope="batch", name=name, default_name="policy_loss")


def _kl_settings(what: str, clamp, bias_correction) -> dict[str, Any]:
    """The KL term's clamp and bias correction as node params: recorded only when set."""
    out: dict[str, Any] = {}
    if clamp is not ESTIMATOR_DEFAULT:
        if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not clamp > 0):
            raise RecipeError(f"{what}: kl_clamp must be a number > 0, or None for no clamp; got {clamp!r}")
        out["kl_clamp"] = None if clamp is None else float(clamp)
    if not isinstance(bias_correction, bool):
        raise RecipeError(f"{what}: kl_bias_correction takes True or False, got {bias_correction!r}")
    if bias_correction:
        out["kl_bias_correction"] = True
    return out


def _loss_constructor(loss: str, doc: str, **defaults):
    def constructor(advantages, logprobs, ref_logprobs=None, **kw) -> Value:
        merged = {**defaults, **kw}
        if ref_logprobs is None:
            merged.pop("kl", None), merged.pop("kl_coef", None)
        return policy_loss(advantages, logprobs, ref_logprobs, loss=loss, **merged)

    constructor.__name__ = f"{loss}_loss"
    constructor.__doc__ = doc
    return constructor


grpo_loss = _loss_constructor(
    "ppo_clip", "GRPO (Shao et al. 2024): clipped ratio, per-sequence token mean, k3 KL at 0.04.",
    agg="seq_mean_token_mean", kl="k3", kl_coef=0.04)
ppo_loss = _loss_constructor("ppo_clip", "PPO clipped surrogate (eps_low/eps_high, dual_clip).")
gspo_loss = _loss_constructor("gspo", "GSPO: sequence-level importance ratio.", agg="seq_mean_token_mean")
cispo_loss = _loss_constructor("cispo", "CISPO (MiniMax-M1): clipped, stop-gradient IS weights.")
reinforce_loss = _loss_constructor("reinforce", "REINFORCE: -A * log pi.")
gpg_loss = _loss_constructor("gpg", "GPG: -A * log pi with GPG's rescaled advantages.")
sapo_loss = _loss_constructor("sapo", "SAPO: soft, sigmoid-gated ratio.", agg="seq_mean_token_mean")
clip_cov_loss = _loss_constructor("clip_cov", "Clip-Cov: detach high-covariance tokens.")
kl_cov_loss = _loss_constructor("kl_cov", "KL-Cov: KL penalty on high-covariance tokens.")


def value_loss(values, targets, *, clip_range: float = 0.2, gamma: float = 1.0, name: str | None = None) -> Value:
    """Clipped value loss. ``targets`` is a GAE node (its returns) or a rewards node (then the
    targets are discounted rewards-to-go, i.e. lambda=1 returns, as VAPO's critic uses)."""
    b = active_builder("ml.value_loss")
    return b.add("value_loss", [values, targets], {"clip_range": clip_range, "gamma": gamma}, scope="batch",
                 name=name, default_name="value_loss")


def dpo_loss(chosen_logprobs, rejected_logprobs, ref_chosen_logprobs=None, ref_rejected_logprobs=None, *,
             loss: str = "sigmoid", beta: float = 0.1, name: str | None = None, **hparams) -> Value:
    """A registered preference loss over sequence log-probs (DPO and friends)."""
    PREFERENCE_LOSSES.get(loss)
    b = active_builder("ml.dpo_loss")
    refs = [x for x in (ref_chosen_logprobs, ref_rejected_logprobs) if x is not None]
    if len(refs) == 1:
        raise RecipeError("ml.dpo_loss needs both reference log-probs or neither")
    return b.add("preference_loss", [chosen_logprobs, rejected_logprobs, *refs],
                 {"loss": loss, "beta": beta, **hparams}, scope="batch", name=name, default_name="dpo_loss")


def set_loss(value, weight: float = 1.0) -> None:
    """Make ``value`` the recipe's only loss term."""
    b = active_builder("ml.set_loss")
    b.losses = [(b.ref(value), float(weight))]


def add_loss(value, weight: float = 1.0) -> None:
    """Add a weighted loss term; the learner minimises the weighted sum."""
    b = active_builder("ml.add_loss")
    b.losses.append((b.ref(value), float(weight)))


def call_tools(step, *, tools, name: str | None = None) -> Value:
    """Run every tool call requested by a generate step through a Toolbox (``ml.mcp_tools``),
    concurrently; the result is the list of ToolResults for the next ``generate_step``. Failures
    (unknown tool, bad arguments, timeouts, crashed servers) are tool results with an error, never
    exceptions."""
    _check_tools(tools, "ml.call_tools", schemas_ok=False)
    b = active_builder("ml.call_tools")
    return b.add("call_tools", [step], {"tools": tools}, scope="episode", name=name, default_name="tool_results",
                 fixed_scope=True)
