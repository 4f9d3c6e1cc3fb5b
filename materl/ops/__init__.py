"""Pure tensor functions: advantages, policy losses, loss aggregation, KL estimators,
preference losses, chunked log-probs, rewards and reference-model policies.

Nothing here imports from the rest of materl except ``materl.registry`` and ``materl.errors``.
"""
