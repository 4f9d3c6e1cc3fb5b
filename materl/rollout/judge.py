"""An LLM judge: a model asked to score episodes against a rubric (a generative reward model).

    judge = Judge(ml.Agent("smollm2-135m-instruct"), "Is the answer correct and polite?")
    score = await judge.score("What is 2+3?", rollout)              # one episode, in [0, 1]
    scores = await judge.rank("What is 2+3?", rollouts)             # a group in one call (RULER)
    judge = Judge("http://127.0.0.1:8000/v1", rubric, model="qwen", api_key="...")   # any OpenAI URL

The judge is a materl ``Agent`` (sampled in process through its engine, like any turn) or the
base URL of an OpenAI-compatible server (``POST <url>/chat/completions``). Calls are bounded by a
semaphore (``max_concurrency``), each attempt by ``timeout_s``; a call that fails or whose answer
cannot be parsed is retried up to ``retries`` times, then raises ``RewardError`` with the last
answer, so the episode fails with it (never a silent 0).

Answers: absolute mode asks for ``Score: <number from 0 to 1>`` and takes the last such line;
relative mode (ART's RULER: the episodes of a group compared in one call) asks for one line
``Response <i>: <score>`` per episode. ``parse=`` replaces the parser: ``parse(text) -> float``
(absolute) or ``parse(text, n) -> list[float]`` (relative), raising on text it cannot read.
(TRL: ``judges.BaseJudge`` / ``PairRMJudge``; verl: generative reward models via a reward manager.)
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from materl.engines.base import SamplingParams
from materl.errors import ConfigError, RewardError
from materl.rollout.episode import EpisodeState, sample_turn
from materl.rollout.http_pools import Pools
from materl.rollout.types import Rollout

_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_RANKED = re.compile(r"response\s*(\d+)\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)

ABSOLUTE = ("You are a strict judge. Score the assistant's response to the task against the rubric.\n"
            "Rubric: {rubric}\nEnd your answer with one line: Score: <a number from 0 to 1>")
RELATIVE = ("You are a strict judge. Compare the {n} responses to the same task against the rubric and "
            "score each relative to the others (better responses higher).\nRubric: {rubric}\n"
            "End your answer with one line per response: Response <i>: <a number from 0 to 1>")


def parse_score(text: str) -> float:
    """The last ``Score: x`` of ``text``, with 0 <= x <= 1."""
    found = _SCORE.findall(text)
    if not found:
        raise RewardError(f"the judge's answer has no 'Score: <number>' line: {text[-300:]!r}")
    value = float(found[-1])
    if not 0.0 <= value <= 1.0:
        raise RewardError(f"the judge's score {value} is outside [0, 1]: {text[-300:]!r}")
    return value


def parse_ranking(text: str, n: int) -> list[float]:
    """Scores from ``Response i: x`` lines (the last line per i), one for each of 1..n, each in [0, 1]."""
    scores: dict[int, float] = {}
    for i, x in _RANKED.findall(text):
        scores[int(i)] = float(x)
    missing = [i for i in range(1, n + 1) if i not in scores]
    if missing:
        raise RewardError(f"the judge scored responses {sorted(scores)} of 1..{n} (missing {missing}): {text[-300:]!r}")
    bad = {i: scores[i] for i in range(1, n + 1) if not 0.0 <= scores[i] <= 1.0}
    if bad:
        raise RewardError(f"the judge's scores {bad} are outside [0, 1]: {text[-300:]!r}")
    return [scores[i] for i in range(1, n + 1)]


def transcript(rollout: Rollout) -> str:
    """The episode after its prompt as plain text: each turn's role and content (and tool calls)."""
    turns = []
    start = next((i for i, m in enumerate(rollout.messages) if m.get("role") == "assistant"), len(rollout.messages))
    for m in rollout.messages[start:]:
        text = str(m.get("content") or "")
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call)
            text += f"\n[calls {fn.get('name')}({fn.get('arguments')})]"
        turns.append(f"[{m.get('role')}] {text.strip()}")
    return "\n".join(turns) if turns else rollout.text


class Judge:
    """See the module docstring."""

    def __init__(self, model: Any, rubric: str, *, api_key: str | None = None, model_name: str = "judge",
                 parse: Callable | None = None, max_concurrency: int = 8, timeout_s: float = 60.0, retries: int = 2,
                 max_new_tokens: int = 256, temperature: float = 0.0):
        if not isinstance(model, str) and not (hasattr(model, "engine") and hasattr(model, "tokenizer")):
            raise ConfigError(f"a judge is a materl Agent or an OpenAI-compatible base URL, got {model!r}")
        if isinstance(model, str) and not model.startswith(("http://", "https://")):
            raise ConfigError(f"judge URL {model!r} must start with http:// or https:// (e.g. http://127.0.0.1:8000/v1)")
        for key, value, low in (("max_concurrency", max_concurrency, 1), ("retries", retries, 0)):
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"judge {key} must be an int >= {low}, got {value!r}")
        if not timeout_s > 0:
            raise ConfigError(f"judge timeout_s must be > 0, got {timeout_s!r}")
        self.model, self.rubric, self.api_key, self.model_name = model, rubric, api_key, model_name
        self.parse, self.max_concurrency, self.timeout_s, self.retries = parse, max_concurrency, timeout_s, retries
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self._limits: dict[int, anyio.Semaphore] = {}  # one per event loop
        self._clients: dict[int, Pools] = {}  # an URL judge's httpx clients, per event loop
        self.calls = 0  # judge requests sent (attempts), for metrics and tests

    def __repr__(self) -> str:
        target = self.model if isinstance(self.model, str) else f"Agent({getattr(self.model, 'name', '?')!r})"
        return f"Judge({target}, rubric={self.rubric[:40]!r})"

    def __getstate__(self):
        return {**self.__dict__, "_limits": {}, "_clients": {}}

    async def score(self, task: str, rollout: Rollout) -> float:
        messages = [{"role": "system", "content": ABSOLUTE.format(rubric=self.rubric)},
                    {"role": "user", "content": f"Task:\n{task}\n\nResponse:\n{transcript(rollout)}"}]
        return await self._ask(messages, lambda text: float((self.parse or parse_score)(text)))

    async def rank(self, task: str, rollouts: Sequence[Rollout]) -> list[float]:
        n = len(rollouts)
        body = "\n\n".join(f"Response {i + 1}:\n{transcript(r)}" for i, r in enumerate(rollouts))
        messages = [{"role": "system", "content": RELATIVE.format(rubric=self.rubric, n=n)},
                    {"role": "user", "content": f"Task:\n{task}\n\n{body}"}]

        def parsed(text: str) -> list[float]:
            scores = [float(x) for x in (self.parse or parse_ranking)(text, n)]
            if len(scores) != n:
                raise RewardError(f"the judge's parse returned {len(scores)} scores for {n} responses")
            return scores

        return await self._ask(messages, parsed)

    async def ask(self, messages: list[dict], parse: Callable[[str], Any]) -> Any:
        """Send ``messages`` as they are (bounded, timed out, retried) until ``parse`` accepts an
        answer: free-form calls built on a judge (``materl.rollout.principles``'s critique)."""
        return await self._ask(messages, parse)

    async def _ask(self, messages: list[dict], parse: Callable[[str], Any]) -> Any:
        """Send ``messages`` (bounded, timed out, retried) until an answer parses."""
        errors = []
        for attempt in range(self.retries + 1):
            async with self._limit():
                self.calls += 1
                try:
                    with anyio.fail_after(self.timeout_s):
                        text = await self._complete(messages)
                except TimeoutError:
                    errors.append(f"attempt {attempt + 1}: no answer within timeout_s={self.timeout_s:g}")
                    continue
                except Exception as exc:  # noqa: BLE001 - a failed call is retried, then reported
                    errors.append(f"attempt {attempt + 1}: {type(exc).__name__}: {exc}")
                    continue
            try:
                return parse(text)
            except Exception as exc:  # noqa: BLE001 - the user's parse= may raise anything
                errors.append(f"attempt {attempt + 1}: unparseable answer ({type(exc).__name__}: {exc})")
        raise RewardError(f"{self!r} failed after {self.retries + 1} attempt(s): " + "; ".join(errors))

    def _limit(self) -> anyio.Semaphore:
        loop = id(asyncio.get_running_loop())
        if loop not in self._limits:
            self._limits = {loop: anyio.Semaphore(self.max_concurrency)}
        return self._limits[loop]

    async def _post(self, messages: list[dict]) -> str:
        """One chat completion from the judge URL: a plain HTTP POST (the ``openai`` client's
        request building costs ~10 ms of CPU a call, which 64 concurrent judge calls feel), on
        connection pools spread per event loop (``materl.rollout.http_pools``)."""
        import httpx

        loop = id(asyncio.get_running_loop())
        if loop not in self._clients:
            self._clients = {loop: Pools(lambda **kw: httpx.AsyncClient(timeout=self.timeout_s, **kw))}
        response = await self._clients[loop].next().post(
            self.model.rstrip("/") + "/chat/completions",
            headers={"authorization": f"Bearer {self.api_key or 'none'}"},
            json={"model": self.model_name, "messages": messages, "max_tokens": self.max_new_tokens,
                  "temperature": self.temperature})
        response.raise_for_status()
        return response.json()["choices"][0]["message"].get("content") or ""

    async def _complete(self, messages: list[dict]) -> str:
        if isinstance(self.model, str):
            return await self._post(messages)
        tokenizer = self.model.tokenizer
        params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature or 1.0,
                                greedy=self.temperature == 0.0, seed=self.calls)
        step = await sample_turn(self.model.engine, tokenizer, EpisodeState.start(tokenizer, messages).ids, params)
        return step.text
