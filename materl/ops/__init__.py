"""Pure tensor functions: advantages, policy losses, loss aggregation, KL estimators,
preference losses, chunked log-probs, rewards and reference-model policies.

Nothing here imports from the rest of materl except ``materl.registry`` and ``materl.errors``.
Importing the package registers the built-in rewards (``reward_builtins``), the ``process``
advantage estimator (``step_credit``) and the turn-level ones (``turn_credit``).
"""

from materl.ops import reward_builtins  # noqa: F401,E402  (registers the built-in rewards and aggregators)
from materl.ops import step_credit  # noqa: F401,E402  (registers the "process" advantage estimator)
from materl.ops import turn_credit  # noqa: F401,E402  (registers the "turn_grpo" and "gigpo" estimators)
from materl.ops import text_rewards  # noqa: F401,E402  (registers the sentiment and toxicity rewards)
