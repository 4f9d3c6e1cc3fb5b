"""The learner stage: batch tensors, prepare (no gradient), then epochs x mini-batches x
micro-batches of forward/backward, gradient clipping and an optimizer step per mini-batch.

Sequences are right-padded ``prompt + completion``; the hidden state that predicts completion
token t of row i sits at ``len(prompt_i) - 1 + t`` and is gathered, so rows with prompts of
different lengths need no position-id juggling. Rows that share a prompt (a GRPO group) run
it once: a prefix pass fills a KV cache that their completions attend to (``completion_hidden``;
``share_prompts=False`` turns it off). Loss aggregations get the mini-batch's global
token/sequence count as their denominator, so summing micro-batch losses equals the mini-batch
loss exactly (gradient accumulation is exact).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from materl import compute
from materl.compiler.scheduler import run_batch_node, store
from materl.compiler.score_ops import as_rollout
from materl.compiler.values import Episode, collate, pad_rows, resolve, to_tensor
from materl.errors import CompileError
from materl.graph.node import Node, ref_node
from materl.rollout.episode import EpisodeState, encode


@dataclass
class SeqBatch:
    input_ids: Tensor  # (B, L) right-padded prompt + completion
    attention_mask: Tensor  # (B, L)
    gather_idx: Tensor  # (B, T) position of the hidden state that predicts completion token t
    completion_ids: Tensor  # (B, T)
    mask: Tensor  # (B, T) float, 1 = trained token (tool output and padding are 0)
    old_logprobs: Tensor  # (B, T) sampling log-probs
    lengths: Tensor  # (B,) prompt + completion length
    prompt_lens: Tensor  # (B,)
    prompt_group: Tensor  # (B,) rows with equal ids have identical prompts

    def rows(self, idx: Tensor) -> SeqBatch:
        length = int(self.lengths[idx].max())
        return SeqBatch(self.input_ids[idx, :length], self.attention_mask[idx, :length],
                        self.gather_idx[idx].clamp(max=length - 1), self.completion_ids[idx], self.mask[idx],
                        self.old_logprobs[idx], self.lengths[idx], self.prompt_lens[idx], self.prompt_group[idx])


def build_seq_batch(tokenizer, prompts: list, completions: list) -> SeqBatch:
    rows = []
    for prompt, comp in zip(prompts, completions):
        if isinstance(comp, str):  # offline text (DPO pairs): the prompt goes through the chat template
            p_ids = EpisodeState.start(tokenizer, prompt).ids
            c_ids = encode(tokenizer, comp) + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
            rows.append((p_ids, c_ids, [1] * len(c_ids), [0.0] * len(c_ids)))
        else:
            r = as_rollout(comp)
            rows.append((r.prompt_ids, r.completion_ids, r.loss_mask, r.sampling_logprobs))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    seqs = [p + c for p, c, _, _ in rows]
    input_ids = pad_rows(seqs, dtype=torch.long, pad=pad)
    attention = pad_rows([[1] * len(s) for s in seqs], dtype=torch.long)
    width = max(1, max(len(c) for _, c, _, _ in rows))
    gather = pad_rows([[len(p) - 1 + t for t in range(len(c))] for p, c, _, _ in rows], dtype=torch.long, width=width)
    gather = torch.maximum(gather, torch.zeros_like(gather))
    groups: dict[tuple[int, ...], int] = {}
    prompt_group = [groups.setdefault(tuple(p), len(groups)) for p, _, _, _ in rows]
    return SeqBatch(input_ids, attention, gather, pad_rows([c for _, c, _, _ in rows], dtype=torch.long, width=width),
                    pad_rows([m for _, _, m, _ in rows], width=width), pad_rows([o for _, _, _, o in rows], width=width),
                    torch.tensor([len(s) for s in seqs]), torch.tensor([len(p) for p, _, _, _ in rows]),
                    torch.tensor(prompt_group))


def _gather(x_B_L_H: Tensor, idx_B_T: Tensor) -> Tensor:
    if x_B_L_H.dim() == 2:
        return x_B_L_H.gather(1, idx_B_T)
    return x_B_L_H.gather(1, idx_B_T[..., None].expand(-1, -1, x_B_L_H.shape[-1]))


def completion_hidden(agent, sb: SeqBatch, *, share_prompts: bool = True) -> Tensor:
    """(B, T, H): the hidden state that predicts each completion token.

    When rows share prompts (a GRPO group) and ``share_prompts``, each distinct prompt is run once
    and its KV cache reused by the rows that continue it (``shared_prefix_hidden_states``): the
    same values as one forward over every full row, for fewer tokens.
    """
    groups_U, owner_B = sb.prompt_group.unique(return_inverse=True)
    if not share_prompts or len(groups_U) == len(owner_B):
        return _gather(agent.hidden_states(sb.input_ids, sb.attention_mask), sb.gather_idx)
    first_U = torch.full_like(groups_U, len(owner_B)).scatter_reduce(0, owner_B, torch.arange(len(owner_B)), "amin")
    plen_U = sb.prompt_lens[first_U]
    width = int(plen_U.max())
    prefix_mask = (torch.arange(width)[None, :] < plen_U[:, None]).long()
    prefix_ids = sb.input_ids[first_U, :width] * prefix_mask
    steps = sb.completion_ids.shape[1] - 1  # the last completion token predicts nothing we train
    suffix_mask = (torch.arange(steps)[None, :] < (sb.lengths - sb.prompt_lens)[:, None]).long()
    last_B_H, suffix_B_S_H = agent.shared_prefix_hidden_states(
        prefix_ids, prefix_mask, owner_B, sb.completion_ids[:, :steps] * suffix_mask, suffix_mask)
    return torch.cat([last_B_H[:, None], suffix_B_S_H], dim=1)


def forward_logprobs(rt, agent, sb: SeqBatch, *, temperature: float, entropy: bool = False):
    from materl.ops.logprobs import token_logprobs

    hidden = completion_hidden(agent, sb, share_prompts=rt.options.share_prompts)
    weight, bias = agent.output_embedding()
    return token_logprobs(hidden, weight, sb.completion_ids, bias=bias,
                          temperature=temperature, chunk_size=rt.options.logprob_chunk_size, return_entropy=entropy)


def forward_values(rt, agent, sb: SeqBatch) -> Tensor:
    return agent.values_of_hidden(completion_hidden(agent, sb, share_prompts=rt.options.share_prompts))


class Learner:
    def __init__(self, rt):
        self.rt = rt
        self.plan = rt.plan
        self.seq: dict[tuple[str, str], SeqBatch] = {}

    # -- batch tensors --
    def seq_batch(self, node: Node, eps: list[Episode]) -> SeqBatch:
        prompts_ref, comps_ref = [r for r in node.inputs if not r.startswith("@")][:2]
        key = (prompts_ref, comps_ref)
        if key not in self.seq:
            agent = self.rt.agents[node.agents[0]]
            self.seq[key] = build_seq_batch(agent.tokenizer, [resolve(e, prompts_ref) for e in eps],
                                            [resolve(e, comps_ref) for e in eps])
        return self.seq[key]

    def temperature(self, node: Node) -> float:
        return node.params.get("temperature", self.rt.options.temperature) or 1.0

    # -- prepare: once per batch, no gradient --
    async def prepare(self, eps: list[Episode]) -> None:
        plan, mb = self.plan, self.rt.options.micro_batch_size or len(eps)
        for name in plan.order:
            node = plan.nodes[name]
            if name in plan.prepare and node.op not in ("logprobs", "values"):
                await run_batch_node(self.rt, name, eps)
            elif node.op in ("logprobs", "values") and (name in plan.prepare or name in plan.live):
                sb = self.seq_batch(node, eps)
                agent = self.rt.agents[node.agents[0]]
                if node.op == "logprobs" and name in plan.live:
                    out = sb.old_logprobs  # the sampling log-probs are the old log-probs
                else:
                    out = await compute.acall(self.forward_no_grad, node, agent, sb, mb)
                for ep, row in zip(eps, out):
                    store(ep, node, row)

    def forward_no_grad(self, node: Node, agent, sb: SeqBatch, micro: int) -> Tensor:
        with torch.no_grad():
            chunks = [torch.arange(i, min(i + micro, len(sb.lengths))) for i in range(0, len(sb.lengths), micro)]
            parts = [forward_values(self.rt, agent, sb.rows(c)) if node.op == "values"
                     else forward_logprobs(self.rt, agent, sb.rows(c), temperature=self.temperature(node))
                     for c in chunks]
            return torch.cat(parts).float()

    # -- update --
    def micro_step(self, eps: list[Episode], idx: Tensor, denoms: dict[str, float]) -> tuple[Tensor, dict]:
        """Forward the live nodes for rows ``idx`` and return the weighted loss and metrics."""
        plan, rt = self.plan, self.rt
        sub = [eps[i] for i in idx.tolist()]
        env: dict[str, Tensor] = {}
        metrics: dict[str, float] = {}
        width = next(iter(self.seq.values())).mask.shape[1] if self.seq else None

        def get(ref: str):
            if ref_node(ref) in env:
                return env[ref_node(ref)]
            values = [resolve(e, ref) for e in sub]
            collated = collate(values)
            return to_tensor(collated, len(sub), width=width) if isinstance(collated, Tensor) else collated

        for name in plan.update:
            node = plan.nodes[name]
            if node.op in ("logprobs", "values"):
                sb = self.seq_batch(node, eps).rows(idx)
                agent = rt.agents[node.agents[0]]
                if node.op == "values":
                    env[name] = forward_values(rt, agent, sb)
                else:
                    logp, ent = forward_logprobs(rt, agent, sb, temperature=self.temperature(node), entropy=True)
                    env[name] = logp
                    metrics["entropy"] = float((ent.detach() * sb.mask).sum() / sb.mask.sum().clamp(min=1))
            elif node.op in LOSS_FNS:
                env[name], m = LOSS_FNS[node.op](self, node, sub, idx, get, denoms)
                metrics.update({f"{k}" if "/" in k else f"{name}/{k}": v for k, v in m.items()})
            elif node.op == "call":
                from materl.compiler.impls import _call_args

                env[name] = node.params["fn"](**_call_args(node, [get(r) for r in node.inputs if not r.startswith("@")]))
            else:
                raise CompileError(f"node {name!r} (op {node.op}) cannot run in the learner update")
        total = sum(w * env[ref_node(r)] for r, w in plan.recipe.losses)
        for r, w in plan.recipe.losses:
            metrics[f"loss/{ref_node(r)}"] = float(env[ref_node(r)].detach())
        return total, metrics

    def run(self, eps: list[Episode]) -> dict[str, float]:
        rt, o = self.rt, self.rt.options
        n = len(eps)
        mini = o.mini_batch_size or n
        micro = o.micro_batch_size or mini
        gen = torch.Generator().manual_seed(o.seed + rt.step_count)
        sums: dict[str, float] = {}
        count = 0
        t0 = time.perf_counter()
        for _ in range(o.epochs):
            order = torch.randperm(n, generator=gen) if o.shuffle else torch.arange(n)
            for start in range(0, n, mini):
                rows = order[start:start + mini]
                denoms = self.denominators(eps, rows)
                for mstart in range(0, len(rows), micro):
                    idx = rows[mstart:mstart + micro]
                    loss, metrics = self.micro_step(eps, idx, denoms)
                    loss.backward()
                    for k, v in metrics.items():
                        sums[k] = sums.get(k, 0.0) + v * (len(idx) / len(rows) if not k.startswith("loss") else 1.0)
                    sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + rt.optimizer_step()
                count += 1
        rt.timings["stage/learner"] = time.perf_counter() - t0
        return {k: v / count for k, v in sums.items()}

    def denominators(self, eps: list[Episode], rows: Tensor) -> dict[str, float]:
        """Global token and sequence counts of a mini-batch, per sequence set."""
        out = {}
        for key, sb in self.seq.items():
            m = sb.mask[rows]
            out[key[1]] = {"tokens": float(m.sum()), "seqs": float((m.sum(-1) > 0).sum())}
        return out


def _denom(agg: str, counts: dict) -> float | None:
    if agg == "token_mean":
        return counts["tokens"]
    if agg.startswith("seq_mean"):
        return counts["seqs"]
    return None


def policy_loss_fn(learner: Learner, node: Node, sub, idx, get, denoms):
    from materl.compiler.kernel_impls import policy_loss_for

    logp_node = learner.plan.nodes[ref_node(node.inputs[1])]
    sb = learner.seq_batch(logp_node, learner.rt.last_episodes).rows(idx)
    adv = get(node.inputs[0])
    logp = get(node.inputs[1])
    ref = get(node.inputs[2]) if len(node.inputs) > 2 else None
    counts = denoms[[r for r in logp_node.inputs if not r.startswith("@")][1]]
    impl = policy_loss_for(learner.plan.impls[node.name])
    return impl(node, logp, sb.old_logprobs, adv, sb.mask, ref, denom=_denom(node.params["agg"], counts))


def value_loss_fn(learner: Learner, node: Node, sub, idx, get, denoms):
    from materl.ops.advantages import discounted_returns
    from materl.ops.aggregate import LOSS_AGG
    from materl.ops.losses import value_loss

    values_node = learner.plan.nodes[ref_node(node.inputs[0])]
    sb = learner.seq_batch(values_node, learner.rt.last_episodes).rows(idx)
    values = get(node.inputs[0])
    old_values = to_tensor([e.values[values_node.name] for e in sub], len(sub), width=values.shape[1])
    target = learner.plan.nodes[ref_node(node.inputs[1])]
    if target.op == "advantages":
        returns = to_tensor([e.values[target.name + ":returns"] for e in sub], len(sub), width=values.shape[1])
    else:
        rewards = to_tensor(get(node.inputs[1]), len(sub), width=values.shape[1])
        if rewards.dim() == 1:
            from materl.compiler.score_ops import _outcome_on_last_token

            rewards = _outcome_on_last_token(rewards, sb.mask)
        returns = discounted_returns(rewards, sb.mask, gamma=node.params["gamma"])
    per_token, stats = value_loss(values, old_values, returns, sb.mask, clip_range=node.params["clip_range"])
    counts = denoms[[r for r in values_node.inputs if not r.startswith("@")][1]]
    loss = LOSS_AGG.get("token_mean")(per_token, sb.mask, denom=counts["tokens"])
    m = {k: float((v.float() * sb.mask).sum() / sb.mask.sum().clamp(min=1)) for k, v in stats.items()}
    return loss, m


def preference_loss_fn(learner: Learner, node: Node, sub, idx, get, denoms):
    from materl.ops.preference import PREFERENCE_LOSSES, sequence_logps

    from materl.ops.preference import LENGTH_NORMALISED

    params = dict(node.params)
    name = params.pop("loss")
    fn = PREFERENCE_LOSSES.get(name)
    seqs, counts = [], None
    for ref in node.inputs:
        src = learner.plan.nodes[ref_node(ref)]
        sb = learner.seq_batch(src, learner.rt.last_episodes).rows(idx)
        counts = counts or denoms[[r for r in src.inputs if not r.startswith("@")][1]]
        seqs.append(sequence_logps(get(ref), sb.mask, average=name in LENGTH_NORMALISED))
    if len(seqs) == 2:  # reference-free (SimPO)
        seqs += [torch.zeros_like(seqs[0]), torch.zeros_like(seqs[0])]
    out = fn(*seqs, **params)
    loss = out.losses_B.sum() / counts["seqs"]
    margin = (out.chosen_rewards_B - out.rejected_rewards_B).detach()
    return loss, {"accuracy": float((margin > 0).float().mean()), "margin": float(margin.mean())}


LOSS_FNS = {"policy_loss": policy_loss_fn, "value_loss": value_loss_fn, "preference_loss": preference_loss_fn}


def _register_learner_ops() -> None:
    from materl.compiler.impls import register

    register("logprobs", "torch-chunked")  # hidden states -> LM head in row chunks (ops.logprobs)
    register("values", "torch")
    for op in LOSS_FNS:
        register(op, "torch")


_register_learner_ops()
