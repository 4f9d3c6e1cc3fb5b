"""Token log-probs of sampled tokens, from hidden states (chunked, memory-bounded) or logits.

``token_logprobs`` fuses the LM head with the log-softmax: it never holds more than one chunk of the logits.
Rows of the flattened (B*T, H) hidden states are processed ``chunk_size`` at a time, and a
custom autograd Function recomputes each chunk's logits in backward, except the last chunk's,
whose probabilities the forward keeps: the autograd graph saves the inputs, two (B*T,) vectors
and at most one chunk's (C,V) probabilities (all of them when B*T <= chunk_size, so a batch
that fits one chunk computes its logits once). Peak extra memory is O(chunk_size * V) instead
of O(B * T * V) (for 8 x 4096 tokens and V = 152k that is 0.6 GiB instead of 19 GiB in fp32).

The naive path, ``logprobs_from_logits``, is for models that return logits.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from materl.errors import ConfigError, ShapeError


def logprobs_from_logits(logits_B_T_V: Tensor, targets_B_T: Tensor, *, temperature: float = 1.0) -> Tensor:
    """``logp[b,t] = log_softmax(logits[b,t] / temperature)[targets[b,t]]``.

    Shapes: (B,T,V), (B,T) int -> (B,T). verl: ``verl.utils.torch_functional.logprobs_from_logits``
    (after ``logits.div_(temperature)``); TRL 1.16: ``selective_log_softmax(logits / temperature,
    ids)``. Like TRL, fp32/fp64 use ``gather - logsumexp`` (no (B,T,V) log-softmax output) and
    fp16/bf16 go row by row through ``log_softmax`` for accuracy. Differentiable by autograd.
    """
    if logits_B_T_V.dim() != 3 or targets_B_T.shape != logits_B_T_V.shape[:2]:
        raise ShapeError(
            f"logprobs_from_logits expects logits (B,T,V) and targets (B,T), got "
            f"{list(logits_B_T_V.shape)} and {list(targets_B_T.shape)}"
        )
    _check_temperature(temperature)
    logits = logits_B_T_V / temperature if temperature != 1.0 else logits_B_T_V
    index = targets_B_T.long().unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        return logits.gather(-1, index).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    rows = [torch.log_softmax(row, dim=-1).gather(-1, idx).squeeze(-1) for row, idx in zip(logits, index)]
    return torch.stack(rows)


def token_logprobs(
    hidden_B_T_H: Tensor,
    lm_head_weight_V_H: Tensor,
    targets_B_T: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    entropy_grad: bool = True,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-prob (and entropy) of each target token through the LM head, in row chunks.

    ``z = (h @ W^T + b) / temperature``; ``logp = z[target] - logsumexp(z)``;
    ``entropy = logsumexp(z) - sum_v softmax(z)_v * z_v`` (entropy of the tempered distribution).

    Shapes: hidden (B,T,H), weight (V,H), targets (B,T) int, bias (V,) -> logp (B,T) [, entropy
    (B,T)]; both in float32, or float64 when the inputs are float64 (the head runs in the input
    dtype; softmax arithmetic is upcast). Gradients flow to hidden, weight and bias.
    Counterpart: verl's ``FusedLinearForPPO`` (``verl.utils.experimental.torch_functional``) and
    TRL 1.16's ``fused_lm_head=True`` model outputs (``log_probs``, ``entropy``); equal, to
    rounding, to ``logprobs_from_logits(h @ W^T + b, targets, temperature=...)``. Deliberate
    difference: no double backward (the backward is hand-written). Targets must be valid ids
    in every position (put any valid id, e.g. pad, where the mask is 0).

    ``entropy_grad=False`` returns the entropy without a gradient (a metric). With a frozen head
    (weight and bias need no gradient, e.g. LoRA) and no entropy gradient, the gradient with
    respect to ``hidden`` is formed in the forward pass, chunk by chunk, from
    ``dlogp/dh = (W[target] - softmax(z) @ W) / temperature``: one (C,V)x(V,H) product per chunk
    instead of the backward's two (the logits' recompute and ``g_z @ W``), and still no (N,V)
    tensor outlives its chunk.
    """
    if hidden_B_T_H.dim() != 3 or lm_head_weight_V_H.dim() != 2 or targets_B_T.shape != hidden_B_T_H.shape[:2]:
        raise ShapeError(
            f"token_logprobs expects hidden (B,T,H), weight (V,H), targets (B,T); got "
            f"{list(hidden_B_T_H.shape)}, {list(lm_head_weight_V_H.shape)}, {list(targets_B_T.shape)}"
        )
    if lm_head_weight_V_H.shape[1] != hidden_B_T_H.shape[2]:
        raise ShapeError(
            f"hidden size {hidden_B_T_H.shape[2]} does not match lm_head weight {list(lm_head_weight_V_H.shape)} (V,H)"
        )
    if bias is not None and bias.shape != lm_head_weight_V_H.shape[:1]:
        raise ShapeError(f"bias must be (V,) = ({lm_head_weight_V_H.shape[0]},), got {list(bias.shape)}")
    _check_temperature(temperature)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ConfigError(f"chunk_size must be a positive int, got {chunk_size!r}")
    B, T, H = hidden_B_T_H.shape
    logp_N, entropy_N = _ChunkedLogprobs.apply(
        hidden_B_T_H.reshape(B * T, H), lm_head_weight_V_H, bias, targets_B_T.reshape(B * T).long(),
        float(temperature), chunk_size, return_entropy, entropy_grad,
    )
    if return_entropy:
        return logp_N.view(B, T), entropy_N.view(B, T)
    return logp_N.view(B, T)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ConfigError(f"temperature must be > 0, got {temperature!r}")


def _chunk_logits(h_C_H: Tensor, weight_V_H: Tensor, bias_V: Tensor | None, temperature: float) -> Tensor:
    """Tempered logits of one chunk, upcast to at least float32: (C,H) -> (C,V), a new tensor
    that the caller may overwrite (``_ChunkedLogprobs`` forms p and g_z in it)."""
    logits = h_C_H @ weight_V_H.T if bias_V is None else torch.addmm(bias_V, h_C_H, weight_V_H.T)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits.div_(temperature) if temperature != 1.0 else logits


class _ChunkedLogprobs(torch.autograd.Function):
    """Forward and backward of :func:`token_logprobs` over (N,H) rows, chunk by chunk.

    Saved for backward: hidden (N,H), weight (V,H), bias (V,), targets (N,), logsumexp (N,). Kept
    beside them (``ctx.p_last_C_V``), unless the entropy has a gradient (which needs z): the last
    chunk's p = softmax(z) (C,V), so the backward recomputes the other chunks' logits only (the
    same ops on the same rows, so the same bits as recomputing the last one too). The backward
    turns that p into g_z in place and drops it; a second backward through the same graph
    (``retain_graph=True``) recomputes it.
    The forward needs z no longer than its chunk: p is formed in z's memory, or, with an entropy,
    in one new tensor and then p*z in z's. Where the backward needs z no longer than p (no entropy
    gradient), g_z is formed in p's memory; with an entropy gradient, g_z and sum_v p_v z_v are
    new and the entropy term is formed in p's and z's. So a chunk allocates one (C,V) tensor in
    the forward (two with an entropy) and at most four in the backward, not up to eight (a chunk
    of 1,024 rows of Qwen2's 151,936-word vocabulary is 594 MiB in float32).
    Backward, per chunk, with p = softmax(z) and m = sum_v p_v z_v:
        dlogp/dz = onehot(target) - p;   dentropy/dz = -p * (z - m)
        g_z = g_logp * dlogp/dz + g_entropy * dentropy/dz;   g_logits = g_z / temperature
        g_h = g_logits @ W;   g_W += g_logits^T @ h;   g_b += sum_rows g_logits
    Frozen head without an entropy gradient ("eager"): saved is dlogp/dh (N,H) alone, formed in
    the forward as (W[target] - p @ W) / temperature; backward is g_h = g_logp * dlogp/dh.
    """

    @staticmethod
    def forward(ctx, hidden_N_H, weight_V_H, bias_V, targets_N, temperature, chunk_size, return_entropy,
                entropy_grad):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        eager = need_h and not need_w and not need_b and not (return_entropy and entropy_grad)
        N = hidden_N_H.shape[0]
        out_dtype = torch.promote_types(hidden_N_H.dtype, torch.float32)
        logp_N = torch.empty(N, dtype=out_dtype, device=hidden_N_H.device)
        lse_N = torch.empty_like(logp_N)
        entropy_N = torch.empty_like(logp_N) if return_entropy else None
        dlogp_dh_N_H = hidden_N_H.new_empty(hidden_N_H.shape, dtype=out_dtype) if eager else None
        keep_last = (need_h or need_w or need_b) and not eager and not (return_entropy and entropy_grad)
        last_start, p_last_C_V = _last_chunk_start(N, chunk_size), None
        for start in range(0, N, chunk_size):
            rows = slice(start, start + chunk_size)
            z_C_V = _chunk_logits(hidden_N_H[rows], weight_V_H, bias_V, temperature)
            lse_C = torch.logsumexp(z_C_V, dim=-1)
            lse_N[rows] = lse_C
            logp_N[rows] = z_C_V.gather(-1, targets_N[rows].unsqueeze(-1)).squeeze(-1) - lse_C
            if return_entropy or eager or (keep_last and start == last_start):
                p_C_V = _softmax(z_C_V, lse_C, in_place=not return_entropy)
            if keep_last and start == last_start:
                p_last_C_V = p_C_V
            if return_entropy:  # the last use of z: sum_v p_v z_v in z's memory
                entropy_N[rows] = lse_C - z_C_V.mul_(p_C_V).sum(-1)
            if eager:
                dlogp_dh_N_H[rows] = _dlogp_dh(p_C_V, weight_V_H, targets_N[rows], temperature)
        ctx.eager, ctx.temperature, ctx.chunk_size, ctx.hidden_dtype = eager, temperature, chunk_size, hidden_N_H.dtype
        ctx.return_entropy = return_entropy and entropy_grad
        ctx.set_materialize_grads(False)
        if eager:
            ctx.save_for_backward(dlogp_dh_N_H)
        else:
            ctx.save_for_backward(hidden_N_H, weight_V_H, bias_V, targets_N, lse_N)
            ctx.p_last_C_V = p_last_C_V  # not a saved tensor: the backward overwrites it, see above
        if entropy_N is None:
            ctx.mark_non_differentiable(lse_N)
            return logp_N, lse_N  # second output is a placeholder; token_logprobs drops it
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy_N)
        return logp_N, entropy_N

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp_N, grad_entropy_N):
        if ctx.eager:
            (dlogp_dh_N_H,) = ctx.saved_tensors
            if grad_logp_N is None:
                return (None,) * 8
            grad_h = (grad_logp_N.unsqueeze(-1).to(dlogp_dh_N_H.dtype) * dlogp_dh_N_H).to(ctx.hidden_dtype)
            return grad_h, None, None, None, None, None, None, None
        hidden_N_H, weight_V_H, bias_V, targets_N, lse_N = ctx.saved_tensors
        p_last_C_V, ctx.p_last_C_V = ctx.p_last_C_V, None  # used up below
        last_start = _last_chunk_start(hidden_N_H.shape[0], ctx.chunk_size)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden_N_H) if need_h else None
        acc_dtype = torch.promote_types(weight_V_H.dtype, torch.float32)
        grad_w = None
        grad_b = torch.zeros(weight_V_H.shape[0], dtype=acc_dtype, device=weight_V_H.device) if need_b else None
        if grad_logp_N is None:
            grad_logp_N = torch.zeros_like(lse_N)
        use_entropy = ctx.return_entropy and grad_entropy_N is not None
        for start in range(0, hidden_N_H.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            h_C_H = hidden_N_H[rows]
            if p_last_C_V is not None and start == last_start:
                p_C_V = p_last_C_V  # kept by the forward (no entropy gradient, so z is not needed)
            else:
                z_C_V = _chunk_logits(h_C_H, weight_V_H, bias_V, ctx.temperature)
                p_C_V = _softmax(z_C_V, lse_N[rows], in_place=not use_entropy)
            if use_entropy:  # p is needed again below
                g_C_V = -grad_logp_N[rows].unsqueeze(-1) * p_C_V
            else:
                g_C_V = p_C_V.mul_(-grad_logp_N[rows].unsqueeze(-1))
            g_C_V.scatter_add_(-1, targets_N[rows].unsqueeze(-1), grad_logp_N[rows].unsqueeze(-1).to(g_C_V.dtype))
            if use_entropy:  # g_z -= (g_entropy * p) * (z - m), using up p and z in place (same order)
                mean_z_C = (p_C_V * z_C_V).sum(-1, keepdim=True)
                g_C_V.sub_(p_C_V.mul_(grad_entropy_N[rows].unsqueeze(-1)).mul_(z_C_V.sub_(mean_z_C)))
            if ctx.temperature != 1.0:
                g_C_V /= ctx.temperature
            if need_h:
                grad_h[rows] = (g_C_V.to(weight_V_H.dtype) @ weight_V_H).to(grad_h.dtype)
            if need_w:
                if start == 0:  # assign the first chunk's product: no zero-fill and add over (V, H)
                    grad_w = g_C_V.T @ h_C_H.to(acc_dtype)
                else:
                    grad_w += g_C_V.T @ h_C_H.to(acc_dtype)
            if need_b:
                grad_b += g_C_V.sum(0)
        grad_w = grad_w.to(weight_V_H.dtype) if need_w else None
        grad_b = grad_b.to(bias_V.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _softmax(z_C_V: Tensor, lse_C: Tensor, *, in_place: bool) -> Tensor:
    """p = exp(z - logsumexp(z)), in z's memory when ``in_place`` (the same bits either way)."""
    p_C_V = z_C_V.sub_(lse_C.unsqueeze(-1)) if in_place else z_C_V - lse_C.unsqueeze(-1)
    return p_C_V.exp_()


def _last_chunk_start(n: int, chunk_size: int) -> int:
    """First row of the last chunk of ``n`` rows (0 when they fit one chunk)."""
    return max(0, (n - 1) // chunk_size * chunk_size)


def _dlogp_dh(p_C_V: Tensor, weight_V_H: Tensor, targets_C: Tensor, temperature: float) -> Tensor:
    """d logp / d h for one chunk: (W[target] - p @ W) / temperature, (C,H) in at least float32
    (the product runs in W's dtype, like the backward's ``g_z @ W``)."""
    acc = torch.promote_types(weight_V_H.dtype, torch.float32)
    expected_C_H = (p_C_V.to(weight_V_H.dtype) @ weight_V_H).to(acc)
    out = weight_V_H[targets_C].to(acc) - expected_C_H
    return out / temperature if temperature != 1.0 else out
