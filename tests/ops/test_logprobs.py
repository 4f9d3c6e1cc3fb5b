import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from materl.errors import ConfigError, ShapeError
from materl.ops.logprobs import logprobs_from_logits, token_logprobs


def _inputs(B=2, T=7, H=5, V=13, bias=True, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, T, H, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=dtype, requires_grad=True) if bias else None
    y = torch.randint(V, (B, T), generator=g)
    return h, w, b, y


def _naive(h, w, b, y, temperature):
    """The full-logits path: (B,T,V) logits, log-softmax, gather; entropy -sum p log p."""
    logits = h @ w.T + (b if b is not None else 0)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, y.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_logprobs_from_logits_hand_computed():
    # logits [0, ln 3] -> softmax [1/4, 3/4]; target 1 -> log(3/4); target 0 -> log(1/4).
    # temperature 2 halves the logits: [0, ln 3 / 2] -> softmax [1/(1+sqrt3), sqrt3/(1+sqrt3)].
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]], dtype=torch.float64)
    targets = torch.tensor([[1, 0]])
    got = logprobs_from_logits(logits, targets)
    torch.testing.assert_close(got, torch.tensor([[math.log(0.75), math.log(0.25)]], dtype=torch.float64))
    got_t = logprobs_from_logits(logits, targets, temperature=2.0)
    s3 = math.sqrt(3.0)
    expected_t = torch.tensor([[math.log(s3 / (1 + s3)), math.log(1 / (1 + s3))]], dtype=torch.float64)
    torch.testing.assert_close(got_t, expected_t)
    # bf16 goes row by row through log_softmax: same numbers to bf16 rounding
    got_bf16 = logprobs_from_logits(logits.bfloat16(), targets)
    torch.testing.assert_close(got_bf16.double(), got, atol=2e-2, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 4, 1024])  # one row, ragged last chunk (14 = 4+4+4+2), one chunk
@pytest.mark.parametrize("bias", [True, False])
def test_chunked_matches_naive_values_and_gradients(temperature, chunk_size, bias):
    h, w, b, y = _inputs(bias=bias)
    params = [t for t in (h, w, b) if t is not None]
    g = torch.Generator().manual_seed(1)
    up_logp, up_ent = (torch.randn(2, 7, generator=g, dtype=torch.float64) for _ in range(2))

    logp, ent = token_logprobs(
        h, w, y, bias=b, temperature=temperature, chunk_size=chunk_size, return_entropy=True
    )
    ref_logp, ref_ent = _naive(h, w, b, y, temperature)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-10)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-10)
    # logprobs_from_logits is the same naive path
    logits = h @ w.T + (b if b is not None else 0)
    from_logits = logprobs_from_logits(logits, y, temperature=temperature)
    torch.testing.assert_close(from_logits, ref_logp, rtol=0, atol=1e-10)

    # gradients through logp alone, entropy alone and both
    for ours, theirs in [
        ((logp * up_logp).sum(), (ref_logp * up_logp).sum()),
        ((ent * up_ent).sum(), (ref_ent * up_ent).sum()),
        ((logp * up_logp + ent * up_ent).sum(), (ref_logp * up_logp + ref_ent * up_ent).sum()),
    ]:
        ours_g = torch.autograd.grad(ours, params, retain_graph=True)
        theirs_g = torch.autograd.grad(theirs, params, retain_graph=True)
        for a, c in zip(ours_g, theirs_g):
            torch.testing.assert_close(a, c, rtol=0, atol=1e-6)


def test_gradcheck_float64():
    h, w, b, y = _inputs(B=1, T=3, H=3, V=6)

    def f(h, w, b):
        return token_logprobs(h, w, y, bias=b, temperature=1.3, chunk_size=2, return_entropy=True)

    assert torch.autograd.gradcheck(f, (h, w, b))


def test_frozen_head_gives_no_weight_grad():
    # LoRA-style: lm_head frozen; only hidden needs a gradient.
    h, w, _, y = _inputs(bias=False)
    w = w.detach()
    logp = token_logprobs(h, w, y, chunk_size=3)
    logp.sum().backward()
    assert w.grad is None and h.grad is not None and logp.shape == (2, 7)
    hh = h.detach().requires_grad_()
    _naive(hh, w, None, y, 1.0)[0].sum().backward()
    torch.testing.assert_close(h.grad, hh.grad, rtol=0, atol=1e-10)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_frozen_head_forms_the_hidden_gradient_in_the_forward_float64(temperature, chunk_size):
    # Frozen weight and bias, entropy a metric: the gradient w.r.t. hidden is formed in the
    # forward from (W[y] - p @ W) / temperature. It must equal the recompute path (entropy_grad
    # left on, same frozen head) and the naive full-logits path, in float64.
    h, w, b, y = _inputs()
    w, b = w.detach(), b.detach()
    up = torch.randn(2, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    logp, ent = token_logprobs(h, w, y, bias=b, temperature=temperature, chunk_size=chunk_size,
                               return_entropy=True, entropy_grad=False)
    assert logp.requires_grad and not ent.requires_grad
    (g_eager,) = torch.autograd.grad((logp * up).sum(), h)
    logp_r, ent_r = token_logprobs(h, w, y, bias=b, temperature=temperature, chunk_size=chunk_size,
                                   return_entropy=True)
    (g_recompute,) = torch.autograd.grad((logp_r * up).sum(), h)
    ref_logp, ref_ent = _naive(h, w, b, y, temperature)
    (g_naive,) = torch.autograd.grad((ref_logp * up).sum(), h)
    torch.testing.assert_close(logp, logp_r, rtol=0, atol=0)
    torch.testing.assert_close(ent, ent_r.detach(), rtol=0, atol=0)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-10)
    torch.testing.assert_close(g_eager, g_recompute, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_eager, g_naive, rtol=0, atol=1e-12)


def test_frozen_head_float32_matches_float64_within_float32_rounding():
    h, w, b, y = _inputs(B=3, T=5, H=16, V=50)
    w, b = w.detach(), b.detach()
    h32 = h.detach().float().requires_grad_()
    logp32 = token_logprobs(h32, w.float(), y, bias=b.float(), chunk_size=4, return_entropy=True,
                            entropy_grad=False)[0]
    logp32.sum().backward()
    token_logprobs(h, w, y, bias=b, chunk_size=4).sum().backward()
    assert h32.grad.dtype == torch.float32
    torch.testing.assert_close(h32.grad.double(), h.grad, rtol=0, atol=1e-5 * float(h.grad.abs().max()))


def test_entropy_without_gradient_on_a_trainable_head():
    h, w, b, y = _inputs()
    logp, ent = token_logprobs(h, w, y, bias=b, chunk_size=4, return_entropy=True, entropy_grad=False)
    assert not ent.requires_grad
    logp.sum().backward()
    hh, ww, bb = (t.detach().requires_grad_() for t in (h, w, b))
    _naive(hh, ww, bb, y, 1.0)[0].sum().backward()
    for a, c in ((h, hh), (w, ww), (b, bb)):
        torch.testing.assert_close(a.grad, c.grad, rtol=0, atol=1e-10)


def _saved_shapes(fn):
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return shapes, out


def test_autograd_graph_saves_no_rows_by_vocab_tensor():
    # N = B*T = 64 rows, V = 128, H = 8, chunk 16: a (N,V) = 8192-element tensor would be the full
    # logits; the largest thing the chunked path may save is the weight (V*H = 1024 elements).
    B, T, H, V = 4, 16, 8, 128
    h, w, b, y = _inputs(B=B, T=T, H=H, V=V, dtype=torch.float32)
    shapes, (logp, ent) = _saved_shapes(
        lambda: token_logprobs(h, w, y, bias=b, chunk_size=16, return_entropy=True)
    )
    assert shapes, "the hook recorded nothing"
    assert max(math.prod(s) for s in shapes) <= V * H
    # everything saved: hidden (N,H), weight (V,H), bias (V,), targets (N,), logsumexp (N,)
    assert sorted(shapes) == sorted([(B * T, H), (V, H), (V,), (B * T,), (B * T,)])
    assert sum(math.prod(s) for s in shapes) < B * T * V
    # the detector works: the naive path saves (B,T,V) tensors
    naive_shapes, _ = _saved_shapes(lambda: _naive(h, w, b, y, 1.0))
    assert (B, T, V) in naive_shapes
    (logp.sum() + ent.sum()).backward()  # and the saved inputs suffice for backward
    assert h.grad.shape == (B, T, H) and w.grad.shape == (V, H) and b.grad.shape == (V,)


@pytest.mark.parametrize("chunk_size,last_rows", [(16, 16), (24, 16), (1024, 64)])  # N = 64 rows
def test_without_an_entropy_gradient_the_last_chunks_probabilities_are_kept(chunk_size, last_rows):
    # No entropy gradient (the learner's case): the forward keeps its last chunk's softmax (C,V) on
    # the autograd node so the backward need not recompute those logits; never more than one chunk
    # (the whole batch when it fits one: 1024 > 64 rows). It is not a saved tensor (the backward
    # overwrites it), and the backward drops it.
    B, T, H, V = 4, 16, 8, 128
    h, w, b, y = _inputs(B=B, T=T, H=H, V=V, dtype=torch.float32)
    for kw in ({}, {"return_entropy": True, "entropy_grad": False}):
        shapes, out = _saved_shapes(lambda: token_logprobs(h, w, y, bias=b, chunk_size=chunk_size, **kw))
        assert sorted(shapes) == sorted([(B * T, H), (V, H), (V,), (B * T,), (B * T,)])
        logp = out[0] if kw else out
        node = logp.grad_fn.next_functions[0][0]  # the view's input: _ChunkedLogprobs' node
        assert node.p_last_C_V.shape == (last_rows, V)
        logp.sum().backward()
        assert node.p_last_C_V is None


class OpSizes(TorchDispatchMode):
    """Records every aten op output while active: ``numels`` the number of elements of each, and
    ``made`` (op name, shape) of each that is a new tensor (not a view, not an in-place op's)."""

    def __init__(self):
        super().__init__()
        self.numels, self.made = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        new = not func.is_view and not func._schema.name.endswith("_")
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numels.append(t.numel())
                if new:
                    self.made.append((func._schema.name, tuple(t.shape)))
        return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size,recomputed", [(16, 3), (1024, 0)])  # N = 64 rows: 4 chunks or 1
def test_the_rows_by_vocab_tensors_each_chunk_allocates(temperature, chunk_size, recomputed):
    # Without an entropy, p = softmax(z) is formed in z's memory and g_z in p's: the only (C,V)
    # tensors made are the logits products, one per chunk in the forward and one per chunk the
    # backward recomputes (all but the kept last one). With the entropy as a metric (the learner's
    # call), the forward adds p beside z (sum p*z then goes into z), and nothing else.
    B, T, H, V = 4, 16, 8, 128
    h, w, b, y = _inputs(B=B, T=T, H=H, V=V, dtype=torch.float32)
    chunks = -(-B * T // chunk_size)

    def rows_by_vocab(**kw):
        with OpSizes() as probe:
            out = token_logprobs(h, w, y, bias=b, temperature=temperature, chunk_size=chunk_size, **kw)
            loss = sum(o.sum() for o in out if o.requires_grad) if kw else out.sum()
            loss.backward()
        return [name for name, shape in probe.made if len(shape) == 2 and shape[1] == V]

    assert rows_by_vocab() == ["aten::addmm"] * (chunks + recomputed)
    entropy = rows_by_vocab(return_entropy=True, entropy_grad=False)
    assert entropy == ["aten::addmm", "aten::sub"] * chunks + ["aten::addmm"] * recomputed
    # an entropy gradient: every chunk recomputed; z, p, g_z and p*z (for sum_v p_v z_v) are made,
    # the entropy term is formed in p's and z's memory
    assert rows_by_vocab(return_entropy=True) == (
        ["aten::addmm", "aten::sub"] * chunks + ["aten::addmm", "aten::sub", "aten::mul", "aten::mul"] * chunks)
    w, b = w.detach(), b.detach()  # the frozen head (LoRA's case): the forward's products only
    assert rows_by_vocab() == ["aten::addmm"] * chunks
    assert rows_by_vocab(return_entropy=True, entropy_grad=False) == ["aten::addmm", "aten::sub"] * chunks


@pytest.mark.parametrize("chunk_size", [4, 1024])  # the kept chunk is the last of four, or the only one
def test_a_second_backward_through_the_graph_recomputes_the_kept_chunk(chunk_size):
    # The first backward turns the kept probabilities into g_z in place; retain_graph=True and a
    # second pass must still give the same gradients (it recomputes them: the same bits).
    h, w, b, y = _inputs(dtype=torch.float32)
    logp = token_logprobs(h, w, y, bias=b, temperature=0.7, chunk_size=chunk_size)
    first = torch.autograd.grad(logp.sum(), (h, w, b), retain_graph=True)
    second = torch.autograd.grad(logp.sum(), (h, w, b))
    for a, c in zip(first, second):
        assert torch.equal(a, c)
    ref_logp, _ = _naive(h, w, b, y, 0.7)
    for a, c in zip(first, torch.autograd.grad(ref_logp.sum(), (h, w, b))):
        torch.testing.assert_close(a, c, rtol=0, atol=1e-5 * float(c.abs().max()))


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])  # one row, ragged last chunk (14 = 4+4+4+2), one chunk
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_kept_chunk_gives_the_same_bits_as_recomputing_it(chunk_size, dtype):
    # entropy_grad=True with a zero entropy gradient recomputes every chunk's logits in backward
    # (z is needed) and subtracts an exact zero: the kept-probabilities path must match it bit for bit.
    h, w, b, y = _inputs(dtype=dtype)
    g = torch.Generator().manual_seed(1)
    up = torch.randn(2, 7, generator=g, dtype=dtype)
    kept_logp, kept_ent = token_logprobs(h, w, y, bias=b, temperature=0.7, chunk_size=chunk_size,
                                         return_entropy=True, entropy_grad=False)
    kept = torch.autograd.grad((kept_logp * up).sum(), (h, w, b))
    logp, ent = token_logprobs(h, w, y, bias=b, temperature=0.7, chunk_size=chunk_size, return_entropy=True)
    recomputed = torch.autograd.grad((logp * up).sum() + (ent * 0.0).sum(), (h, w, b))
    assert torch.equal(kept_logp, logp) and torch.equal(kept_ent, ent.detach())
    for a, c in zip(kept, recomputed):
        assert torch.equal(a, c)
    if dtype == torch.float64:  # and both are the naive full-logits gradient
        ref_logp, _ = _naive(h, w, b, y, 0.7)
        for a, c in zip(kept, torch.autograd.grad((ref_logp * up).sum(), (h, w, b))):
            torch.testing.assert_close(a, c, rtol=0, atol=1e-10)


def test_no_op_in_forward_or_backward_makes_a_rows_by_vocab_tensor():
    # Stronger than the saved-tensor check: record the output size of every aten op run in the
    # forward and the backward. With N = 64 rows, chunk 16, V = 128, the biggest op output may be
    # one chunk's logits (16*128 = 2048 elements), never the full (N,V) = 8192.
    B, T, H, V = 4, 16, 8, 128
    h, w, b, y = _inputs(B=B, T=T, H=H, V=V, dtype=torch.float32)
    with OpSizes() as chunked:
        logp, ent = token_logprobs(h, w, y, bias=b, chunk_size=16, return_entropy=True)
        (logp.sum() + ent.sum()).backward()
    assert chunked.numels and max(chunked.numels) == 16 * V
    with OpSizes() as naive:
        sum(_naive(h, w, b, y, 1.0)).sum().backward()
    assert max(naive.numels) == B * T * V  # the probe sees full logits when they exist


def test_frozen_head_saves_one_rows_by_hidden_tensor_and_makes_no_rows_by_vocab_tensor():
    # The eager path saves dlogp/dh (N,H) alone; every op output is at most one chunk's logits.
    B, T, H, V = 4, 16, 8, 128
    h, w, b, y = _inputs(B=B, T=T, H=H, V=V, dtype=torch.float32)
    w, b = w.detach(), b.detach()
    shapes, (logp, _) = _saved_shapes(
        lambda: token_logprobs(h, w, y, bias=b, chunk_size=16, return_entropy=True, entropy_grad=False))
    assert shapes == [(B * T, H)]
    with OpSizes() as sizes:
        logp, _ = token_logprobs(h, w, y, bias=b, chunk_size=16, return_entropy=True, entropy_grad=False)
        logp.sum().backward()
    assert sizes.numels and max(sizes.numels) == 16 * V


def test_bfloat16_inputs_give_float32_logp_and_bf16_grads():
    h, w, b, y = _inputs(dtype=torch.float64)
    ref, _ = _naive(h, w, b, y, 1.0)
    hb, wb, bb = (t.detach().bfloat16().requires_grad_() for t in (h, w, b))
    logp = token_logprobs(hb, wb, y, bias=bb, chunk_size=4)
    assert logp.dtype == torch.float32
    logp.sum().backward()
    assert hb.grad.dtype == wb.grad.dtype == bb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logp.double(), ref.detach(), atol=0.15, rtol=0)


def test_errors():
    h, w, b, y = _inputs()
    with pytest.raises(ShapeError, match=r"hidden size 5 does not match lm_head weight \[13, 4\]"):
        token_logprobs(h, w[:, :4], y)
    with pytest.raises(ShapeError, match=r"targets \(B,T\)"):
        token_logprobs(h, w, y[:, :3])
    with pytest.raises(ShapeError, match=r"bias must be \(V,\)"):
        token_logprobs(h, w, y, bias=b[:3])
    with pytest.raises(ConfigError, match="chunk_size must be a positive int, got 0"):
        token_logprobs(h, w, y, chunk_size=0)
    with pytest.raises(ConfigError, match="temperature must be > 0, got 0.0"):
        logprobs_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
