"""Self-play on two-player text games: the policy plays both seats (or against a frozen
opponent), each seat's turns an episode of its own, rewarded by the game's outcome.

    from materl.recipes.self_play import self_play, self_play_recipe
    step = ml.compile(self_play, policy=ml.Agent("smollm2-135m-instruct", trainable=True), group_size=4)
    vs = self_play_recipe("TicTacToe-v0", opponent=True)      # recipe vs(policy, opponent, prompts)
    step = ml.compile(vs, policy=ml.Agent(name, trainable=True), opponent=ml.Agent(name), group_size=4)

Closest published method: SPIRAL (Liu et al. 2025, arXiv:2506.24119), which trains one model on
both seats of zero-sum text games (TicTacToe, Kuhn Poker, Simple Negotiation from textarena) with
role-conditioned advantage estimation (a running baseline per game and role). Differences: the
baseline is GRPO's group statistics over the episodes of one prompt, all seats together (a
group is ``group_size / 2`` games from the same opening, so the first-mover's edge is in the
baseline as an average, not removed per role); no KL term (``ml.with_kl`` adds one); the loss is
the clipped surrogate averaged over tokens, as the agentic recipes here are. ``opponent=True``
is the fictitious-play-free baseline SPIRAL compares with: training against a fixed opponent.
Not a built-in name (``materl recipes``): a game is part of the graph, so the recipe is built for
one (``self_play`` is TicTacToe-v0).
"""

import materl as ml
from materl.rollout.self_play import game_outcome


def self_play_recipe(game="TicTacToe-v0", *, opponent: bool = False, max_moves: int | None = None):
    """The recipe for ``game`` (a textarena id or a two-player game factory); ``opponent=True``
    adds an ``opponent`` agent parameter that plays the other seat, untrained."""
    if opponent:
        @ml.recipe
        def self_play_vs_opponent(policy, opponent, prompts):
            rollout = ml.self_play(policy, prompts, game=game, opponent=opponent, max_moves=max_moves, name="rollout")
            rewards = ml.reward(game_outcome, rollout=rollout, name="game")
            advantages = ml.advantages(rewards, estimator="grpo", completions=rollout, name="advantages")
            ml.set_loss(ml.policy_loss(advantages, ml.logprobs(policy, prompts, rollout), agg="token_mean"))

        return self_play_vs_opponent

    @ml.recipe
    def self_play(policy, prompts):
        rollout = ml.self_play(policy, prompts, game=game, max_moves=max_moves, name="rollout")
        rewards = ml.reward(game_outcome, rollout=rollout, name="game")
        advantages = ml.advantages(rewards, estimator="grpo", completions=rollout, name="advantages")
        ml.set_loss(ml.policy_loss(advantages, ml.logprobs(policy, prompts, rollout), agg="token_mean"))

    return self_play


self_play = self_play_recipe()


def refresh_opponent(policy, opponent) -> None:
    """Make ``opponent`` an earlier copy of ``policy``: its weights become the policy's current
    ones (copied, so later updates of the policy do not reach it) and its engine samples from
    them. Called every K steps (``ml.train(on_step=...)``, ``examples/self_play.py
    --refresh-opponent-every K``) it plays against the policy of up to K steps ago, as
    self-play against a lagged copy does (SPIRAL's ablation; AlphaStar's past-self league in its
    simplest form). The two agents must be the same model (same parameter names and shapes)."""
    from materl.errors import ConfigError

    state = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    try:
        opponent.model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ConfigError(f"refresh_opponent: the opponent {opponent.name!r} is not the same model as the policy "
                          f"{policy.name!r} (e.g. one has LoRA adapters): {str(e).splitlines()[0]}") from e
    opponent.engine.sync_weights()
