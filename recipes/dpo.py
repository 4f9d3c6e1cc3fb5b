"""DPO — Direct Preference Optimization (Rafailov et al. 2023, arXiv:2305.18290).

Offline and learner-only: no generation. Each row of ``pairs`` has ``prompt``, ``chosen`` and
``rejected``; the loss is -log sigmoid(beta * (chosen log-ratio - rejected log-ratio)), with the
log-ratios against a frozen reference, and matches TRL's DPOTrainer (loss_type "sigmoid").
Other preference losses (ipo, hinge, robust, simpo) are a ``loss=`` away.

    step = ml.compile(dpo, policy=policy, ref_policy=ref)
    step.run(pairs=[{"prompt": ..., "chosen": ..., "rejected": ...}, ...])
"""

import materl as ml


@ml.recipe
def dpo(policy, ref_policy, pairs):
    chosen = ml.logprobs(policy, pairs.prompt, pairs.chosen, name="chosen_logprobs")
    rejected = ml.logprobs(policy, pairs.prompt, pairs.rejected, name="rejected_logprobs")
    ref_chosen = ml.logprobs(ref_policy, pairs.prompt, pairs.chosen, name="ref_chosen_logprobs")
    ref_rejected = ml.logprobs(ref_policy, pairs.prompt, pairs.rejected, name="ref_rejected_logprobs")
    ml.set_loss(ml.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, loss="sigmoid", beta=0.1))
