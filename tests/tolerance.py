"""Float comparisons that are honest about float32.

A float32 value carries ~7 significant digits of the *largest* values it was computed from: a
gradient element of 1e-3 summed next to elements of 100 has an absolute error of ~1e-5, however
small it is itself. ``assert_close_to_scale`` therefore compares with an absolute tolerance that
is a fraction of the expected tensor's largest magnitude (and no relative term), so one tiny
element computed by a different but equivalent order of operations cannot fail a test that a
wrong formula would fail by orders of magnitude more.
"""

from __future__ import annotations

import torch

FLOAT32_REL = 1e-5  # ~100 float32 ulps of the tensor's scale


def scale_tolerance(expected: torch.Tensor, rel: float = FLOAT32_REL) -> float:
    """The absolute tolerance ``rel * max|expected|``."""
    return rel * max(float(expected.detach().abs().max()) if expected.numel() else 0.0, 1e-30)


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, *, rel: float = FLOAT32_REL,
                          msg: str = "") -> None:
    """|actual - expected| <= rel * max|expected| elementwise (shapes and dtypes must agree)."""
    atol = scale_tolerance(expected, rel)
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=atol,
                               msg=lambda m: f"{msg}: {m} (tolerance {atol:.3g} = {rel:g} x scale)" if msg else m)


def assert_same_update(after: list[torch.Tensor], expected_after: list[torch.Tensor], before: list[torch.Tensor],
                       *, rel: float = 1e-6, margin: float = 100.0) -> None:
    """Two optimizer steps from ``before`` agree: each parameter to ``rel`` of its own scale (float32
    stores the parameter, so its rounding is of that scale), and the update itself is at least
    ``margin`` times that tolerance somewhere, so a wrong update could not pass unnoticed."""
    largest = 0.0
    for a, b, p0 in zip(after, expected_after, before, strict=True):
        atol = scale_tolerance(b, rel)
        torch.testing.assert_close(a, b, rtol=0.0, atol=atol)
        largest = max(largest, float((b - p0).abs().max()) / atol)
    assert largest >= margin, f"the update is only {largest:.1f}x the tolerance; the comparison would not see a wrong one"
