"""Rows checked against the compiled step that will run them: the columns its rewards read, and
each prompt's length in tokens against the model's context.

    rows = prepare_rows(step, "data/train.jsonl", max_prompt_tokens=1024, truncation="left")

A prompt is measured exactly as the rollout will tokenize it: ``EpisodeState.start`` renders it
with the agent's chat template, the system prompt and the tool schemas the generating node
shows, once per row. Its limit is the model's ``max_position_embeddings`` minus the node's
``max_new_tokens`` (a first turn must fit with its answer), and ``max_prompt_tokens`` when
given. A longer prompt is an error naming the row, or with ``truncation="left"`` / ``"right"``
its last user message is cut, in tokens, from the start (keeping the end) or from the end.
(verl: ``data.max_prompt_length`` with ``truncation: error|left|right|middle``, cutting the
rendered ids; materl cuts the message text and renders again, so the chat template's own
tokens and the tool schemas are never cut.)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from materl.agent import model_context
from materl.errors import ConfigError, DataError
from materl.ops.rewards import BATCH_KEYS, REWARDS
from materl.rollout.multiturn import EpisodeState, encode, prompt_messages
from materl.rollout.mcp import Toolbox
from materl.runtime.data import Row, check_columns, load_rows, raise_problems

TRUNCATION = ("error", "left", "right")
PROMPT_OPS = ("generate", "generate_step")  # ops that render a row's prompt for a model
_PROVIDED = (*BATCH_KEYS, "group_ids")  # reward keywords the batch fills, never a row's column


def prepare_rows(compiled, data: Any, *, where: str | None = None, max_prompt_tokens: int | None = None,
                 truncation: str = "error") -> list[Row]:
    """``load_rows(data)``, then every row checked for the columns ``compiled``'s rewards read
    and its prompt's length (truncated when asked); DataError naming the bad rows."""
    rows = load_rows(data, where=where)
    check_columns(rows, reward_columns(compiled.plan))
    return fit_prompts(compiled, rows, max_prompt_tokens=max_prompt_tokens, truncation=truncation)


def reward_columns(plan) -> dict[str, list[str]]:
    """Dataset columns the plan's reward terms need: keyword parameters of a reward function
    with no default that neither the batch (completions, prompts, ...) nor the term's params
    supply. Column -> labels of the terms that read it."""
    needed: dict[str, list[str]] = {}
    for node in plan.nodes.values():
        for term in node.params.get("terms", ()) if node.op == "rewards" else ():
            fn = term.get("fn")
            fn = REWARDS.get(fn) if isinstance(fn, str) else fn
            try:
                params = inspect.signature(fn).parameters.values() if fn is not None else ()
            except (TypeError, ValueError):
                continue
            for p in params:
                if (p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
                        and p.name not in _PROVIDED and p.name not in term.get("params", {})):
                    needed.setdefault(p.name, []).append(term.get("label") or getattr(fn, "__name__", "?"))
    return needed


@dataclass(frozen=True)
class _Site:
    """A node that renders a row's prompt for a model, and the token limit of that prompt."""
    node: str
    agent: str
    tokenizer: Any
    tools: list | None
    system: str | None
    limit: int
    why: str  # how the limit was reached, for messages


def prompt_sites(compiled, max_prompt_tokens: int | None = None) -> list[_Site]:
    """The plan's nodes that render a row's prompt (generate, generate_step on a data input)."""
    plan, options = compiled.plan, compiled.options
    data_inputs = {n for n, node in plan.nodes.items() if node.op == "input"}
    sites = []
    for node in plan.nodes.values():
        if node.op not in PROMPT_OPS or not data_inputs & set(node.inputs) or not node.agents:
            continue
        name = node.agents[0]
        agent = compiled.agents[name]
        new = node.params.get("max_new_tokens", options.max_new_tokens)
        context = model_context(agent)
        limits = []
        if context is not None:
            if context <= new:
                raise ConfigError(f"node {node.name!r}: max_new_tokens={new} leaves no room for a prompt in the "
                                  f"{context}-token context (max_position_embeddings) of agent {name!r}")
            limits.append((context - new, f"the context of agent {name!r} ({context} positions, "
                                          f"max_position_embeddings) less max_new_tokens={new}"))
        if max_prompt_tokens is not None:
            limits.append((max_prompt_tokens, f"max_prompt_tokens={max_prompt_tokens}"))
        if not limits:
            continue
        limit, why = min(limits)
        tools = node.params.get("tools")
        specs = tools.tools if isinstance(tools, Toolbox) else tools  # a Toolbox, or OpenAI function specs
        sites.append(_Site(node.name, name, agent.tokenizer, list(specs) if specs else None,
                           node.params.get("system", options.system_prompt), limit, why))
    return sites


def fit_prompts(compiled, rows: list[Row], *, max_prompt_tokens: int | None = None,
                truncation: str = "error") -> list[Row]:
    """``rows`` with every prompt within its limit (see the module docstring): the same rows, or
    copies with a cut prompt under ``truncation="left"|"right"``; DataError naming each row over
    it under ``"error"`` (or one whose template and tool schemas alone are over it)."""
    if truncation not in TRUNCATION:
        raise ConfigError(f"truncation={truncation!r}; accepted: {', '.join(TRUNCATION)}")
    if max_prompt_tokens is not None and (not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1):
        raise ConfigError(f"max_prompt_tokens={max_prompt_tokens!r}; accepted: an integer >= 1 or None")
    if any(isinstance(s, Toolbox) and not s.started for s in compiled.services.all):
        compiled.call_blocking(compiled.start_services)  # their schemas are part of the prompt
    sites = prompt_sites(compiled, max_prompt_tokens)
    out, problems = [], []
    for row in rows:
        for site in sites:
            key = "prompt" if "prompt" in row else "messages"
            if key not in row:
                continue
            try:
                prompt = _fit(site, row[key], truncation)
            except DataError as e:
                problems.append(f"{row.origin or 'row'}: {e}")
                break
            if prompt is not row[key]:
                row = Row({**row, key: prompt}, row.origin)
        out.append(row)
    raise_problems(problems, what="prompt")
    return out


def prompt_length(site: _Site, prompt: Any) -> int:
    """Tokens of ``prompt`` as node ``site`` renders it (template, system prompt, tool schemas)."""
    return len(EpisodeState.start(site.tokenizer, prompt, system=site.system, tools=site.tools).ids)


def _fit(site: _Site, prompt: Any, truncation: str) -> Any:
    n = prompt_length(site, prompt)
    if n <= site.limit:
        return prompt
    extra = f" and {len(site.tools)} tool schemas" if site.tools else ""
    if truncation == "error":
        raise DataError(f"the prompt is {n} tokens (with the chat template{extra}, as node {site.node!r} renders "
                        f"it), over the limit of {site.limit}: {site.why}; shorten it, or set truncation "
                        f"(data.truncation: left|right) to cut it")
    messages = prompt_messages(prompt)
    j = max(i for i, m in enumerate(messages) if m["role"] == "user")
    ids = encode(site.tokenizer, messages[j]["content"])
    keep = len(ids) - (n - site.limit)
    for _ in range(4):  # text re-tokenizes within a few tokens of the cut; cut again by what is over
        if keep <= 0:
            break
        text = site.tokenizer.decode(ids[-keep:] if truncation == "left" else ids[:keep])
        cut = text if isinstance(prompt, str) else [*messages[:j], {**messages[j], "content": text}, *messages[j + 1:]]
        n = prompt_length(site, cut)
        if n <= site.limit:
            return cut
        keep -= n - site.limit
    raise DataError(f"the prompt cannot be cut to {site.limit} tokens ({site.why}): its chat template{extra} and the "
                    f"other messages take more than that without its last user message")

