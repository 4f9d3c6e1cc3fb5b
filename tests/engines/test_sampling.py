"""The per-row sampling step of the in-process engine, on hand-made logits."""

import math

import torch

from materl.engines.transformers_engine import sample_tokens, top_k_top_p_filter

# One row with probabilities (0.5, 0.3, 0.2) at T = 1.
P = torch.tensor([0.5, 0.3, 0.2])
LOGITS = P.log()[None, :]


def _sample(u, *, t=1.0, k=0, p=1.0, greedy=False, logits=LOGITS):
    rows = logits.size(0)
    return sample_tokens(
        logits, torch.full((rows,), u),
        temperature_B=torch.full((rows,), t), top_k_B=torch.full((rows,), k),
        top_p_B=torch.full((rows,), p), greedy_B=torch.full((rows,), greedy),
    )


def test_inverse_cdf_picks_the_bucket_u_falls_in():
    # cdf = (0.5, 0.8, 1.0): u=0.45 -> 0, u=0.55 -> 1, u=0.95 -> 2
    assert [_sample(u)[0].item() for u in (0.45, 0.55, 0.95)] == [0, 1, 2]


def test_logprob_is_log_softmax_of_logits_over_temperature():
    # T=2: probs ∝ sqrt(p) = (.70711, .54772, .44721), sum 1.70204 -> p1 = .32180
    tok, lp = _sample(0.6, t=2.0)  # cdf at T=2: (.41545, .73725, 1) -> u=.6 lands on token 1
    assert tok.item() == 1
    expected = math.log(math.sqrt(0.3) / (math.sqrt(0.5) + math.sqrt(0.3) + math.sqrt(0.2)))
    assert abs(lp.item() - expected) < 1e-6


def test_top_p_keeps_smallest_prefix_reaching_p_and_logprob_is_not_renormalised():
    # top_p = 0.6: mass before token 1 is 0.5 < 0.6 (kept), before token 2 is 0.8 (removed).
    # filtered probs = (0.5, 0.3) / 0.8 = (0.625, 0.375): u=0.95 -> token 1, never token 2.
    filtered = top_k_top_p_filter(LOGITS, torch.tensor([0]), torch.tensor([0.6]))
    assert torch.allclose(filtered.softmax(-1), torch.tensor([[0.625, 0.375, 0.0]]))
    tok, lp = _sample(0.95, p=0.6)
    assert tok.item() == 1
    assert abs(lp.item() - math.log(0.3)) < 1e-6  # the unfiltered log-prob


def test_top_k_then_top_p_and_tiny_top_p_is_greedy():
    # top_k=2 leaves (0.625, 0.375); top_p=0.6 then keeps only token 0 (mass before token 1 = .625)
    filtered = top_k_top_p_filter(LOGITS, torch.tensor([2]), torch.tensor([0.6]))
    assert torch.isinf(filtered[0, 1:]).all() and filtered[0, 0].item() == LOGITS[0, 0].item()
    assert _sample(0.99, p=1e-6)[0].item() == 0
    assert _sample(0.99, k=1)[0].item() == 0


def test_greedy_ignores_the_uniform_and_rows_are_independent():
    logits = torch.stack([LOGITS[0], LOGITS[0].flip(0)])  # row 1 prefers token 2
    tok, _ = _sample(0.99, greedy=True, logits=logits)
    assert tok.tolist() == [0, 2]
    # a row's draw depends only on its own u. Row 1 has probs (0.2, 0.3, 0.5), cdf (0.2, 0.5, 1):
    # u=0.9 -> token 2; row 0 with u=0.45 -> token 0 whatever row 1 is.
    both = sample_tokens(
        logits, torch.tensor([0.45, 0.9]), temperature_B=torch.ones(2), top_k_B=torch.zeros(2, dtype=torch.long),
        top_p_B=torch.ones(2), greedy_B=torch.tensor([False, False]),
    )[0]
    assert both.tolist() == [0, 2]
    alone = _sample(0.45, logits=logits[:1])[0]
    assert alone.tolist() == [0]


def test_zero_probability_tokens_are_never_drawn():
    logits = torch.tensor([[0.0, float("-inf"), 0.0]])  # (0.5, 0, 0.5)
    draws = {_sample(u, logits=logits)[0].item() for u in torch.linspace(0, 0.999, 101).tolist()}
    assert draws == {0, 2}
