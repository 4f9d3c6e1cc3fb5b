"""Generation on a running SGLang server, over its native HTTP API.

    engine = SGLangEngine("http://localhost:30000", export_weights=agent.save_pretrained)
    gen = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=64))
    engine.sync_weights()        # after a learner step: save, /update_weights_from_disk, /flush_cache

Requests go to ``POST /generate`` with ``input_ids`` (never text: ids in, ids out) and
``return_logprob=True``; the server batches concurrent requests itself (continuous batching),
so this engine just keeps many requests in flight on one ``httpx.AsyncClient``. Token ids and
log-probs come from ``meta_info.output_token_logprobs`` (``[logprob, token_id, text|None]`` per
token). Launch the server *without* ``SGLANG_RETURN_ORIGINAL_LOGPROB`` so the log-probs are
log_softmax(logits / T), the materl contract. Greedy requests are sent as ``temperature=0``,
for which SGLang reports T=1 log-probs.

Weight sync writes the agent's weights (LoRA merged) as safetensors into ``model_path`` (a
folder the server can read; default a fresh temp folder, so server and trainer must share a
filesystem) and asks the server to reload them. (verl/slime use the same endpoints or NCCL.)
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import anyio.lowlevel
import httpx

from materl.engines.base import ENGINES, Generation, SamplingParams
from materl.errors import ConfigError, EngineError

URL_ENV = "MATERL_SGLANG_URL"


@ENGINES.register("sglang")
class SGLangEngine:
    """Client of one SGLang server; ``sync_weights`` pushes an agent's weights to it."""

    runs_on_cuda = True  # the server's device is its own; the agent may sit anywhere
    deterministic_options: dict = {}  # the server batches as it likes; nothing here changes that

    def __init__(
        self,
        url: str | None = None,
        *,
        model_path: str | os.PathLike | None = None,
        timeout_s: float = 600.0,
        export_weights: Callable[[str], None] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        sync_transport: httpx.BaseTransport | None = None,
    ):
        url = url or os.environ.get(URL_ENV)
        if not url:
            raise ConfigError(f"SGLangEngine needs a server url (argument or ${URL_ENV}); got none")
        self.url = url.rstrip("/")
        self.model_path = str(model_path) if model_path is not None else None
        self.timeout_s = timeout_s
        self.export_weights = export_weights
        self._transport = transport
        self._sync_transport = sync_transport
        self._clients: dict[object, httpx.AsyncClient] = {}
        self.stats = {"requests": 0, "tokens": 0, "weight_syncs": 0}

    @classmethod
    def for_agent(cls, agent, **options) -> "SGLangEngine":
        options.setdefault("export_weights", agent.save_pretrained)
        return cls(**options)

    def __repr__(self) -> str:
        return f"SGLangEngine({self.url!r})"

    # -- generation -------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Generation:
        """POST /generate for one request; the server batches concurrent ones."""
        params = params or SamplingParams()
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise EngineError("generate() needs at least one prompt token; got an empty prompt")
        body = request_body(ids, params)
        try:
            response = await self._client().post(f"{self.url}/generate", json=body)
        except httpx.HTTPError as exc:
            raise EngineError(f"SGLang server {self.url} unreachable for /generate: {exc!r}") from exc
        data = _json_or_raise(response, "/generate")
        gen = parse_generation(data, prompt_len=len(ids))
        self.stats["requests"] += 1
        self.stats["tokens"] += len(gen.token_ids)
        return gen

    def _client(self) -> httpx.AsyncClient:
        """One client per event loop (an AsyncClient cannot outlive the loop it was used on)."""
        key = anyio.lowlevel.current_token()
        client = self._clients.get(key)
        if client is None or client.is_closed:
            self._clients = {k: c for k, c in self._clients.items() if not c.is_closed}
            client = httpx.AsyncClient(timeout=self.timeout_s, transport=self._transport)
            self._clients[key] = client
        return client

    def sleep(self) -> None:
        """Nothing decode-only lives in this process (the server holds its own memory)."""

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()

    # -- weights ----------------------------------------------------------------------------

    def sync_weights(self) -> None:
        """Save the agent's weights to ``model_path`` and have the server load them:
        ``POST /update_weights_from_disk {"model_path": ...}`` then ``POST /flush_cache`` (the
        radix cache holds KV computed with the old weights)."""
        if self.export_weights is None:
            raise EngineError(
                "SGLangEngine.sync_weights needs export_weights (a function saving HF-format "
                "weights into a folder); create the engine through an Agent or pass one"
            )
        folder = self.model_path or tempfile.mkdtemp(prefix="materl-sglang-")
        self.export_weights(folder)
        with httpx.Client(timeout=self.timeout_s, transport=self._sync_transport) as client:
            try:
                update = client.post(f"{self.url}/update_weights_from_disk", json={"model_path": folder})
                data = _json_or_raise(update, "/update_weights_from_disk")
                if isinstance(data, dict) and data.get("success") is False:
                    raise EngineError(f"SGLang /update_weights_from_disk failed for {folder}: {data.get('message')}")
                _json_or_raise(client.post(f"{self.url}/flush_cache"), "/flush_cache", want_json=False)
            except httpx.HTTPError as exc:
                raise EngineError(f"SGLang server {self.url} unreachable during weight sync: {exc!r}") from exc
        self.stats["weight_syncs"] += 1


def request_body(prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """The /generate JSON for one request (SGLang ``GenerateReqInput`` + ``SamplingParams``).

    ``top_k=0`` (off) becomes SGLang's -1; greedy becomes temperature 0; stop strings stay in
    the text (``no_stop_trim``) and special tokens are kept so the text decodes the exact ids;
    a seed is sent as ``sampling_seed`` (honoured by servers launched with
    ``--enable-deterministic-inference``).
    """
    greedy = params.greedy or params.temperature == 0
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": 0.0 if greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "stop": list(params.stop_strings),
        "stop_token_ids": list(params.stop_token_ids),
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if params.seed is not None:
        sampling["sampling_seed"] = int(params.seed)
    return {"input_ids": prompt_ids, "sampling_params": sampling, "return_logprob": True,
            "logprob_start_len": -1}


def parse_generation(data: Any, *, prompt_len: int) -> Generation:
    """A /generate response -> Generation (ids and log-probs from meta_info, exactly)."""
    if isinstance(data, list):  # a batch response; we always send one request
        data = data[0]
    meta = data.get("meta_info") or {}
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise EngineError(f"SGLang /generate response has no meta_info.output_token_logprobs "
                          f"(keys: {sorted(meta)}); was return_logprob dropped?")
    ids, logprobs = [], []
    for entry in entries:
        if isinstance(entry, dict):
            lp, tid = entry.get("logprob"), entry.get("token_id")
        else:
            lp, tid = entry[0], entry[1]
        ids.append(int(tid))
        logprobs.append(float(lp))
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else str(finish)
    if kind == "abort":
        raise EngineError(f"SGLang aborted the request: {finish.get('message', finish)}")
    if kind == "length":
        reason = "length"
    elif kind == "stop" and isinstance(finish.get("matched"), str):
        reason = "stop_string"
    else:
        reason = "stop"
    text = data.get("text", "")
    return Generation(ids, logprobs, reason, prompt_len=prompt_len,
                      metadata={"text": text, "sglang_finish": finish, "id": meta.get("id")})


def _json_or_raise(response: httpx.Response, endpoint: str, *, want_json: bool = True) -> Any:
    if response.status_code >= 400:
        try:
            detail = _error_message(response.json())
        except ValueError:
            detail = response.text
        raise EngineError(f"SGLang {endpoint} returned HTTP {response.status_code}: {detail}")
    if not want_json:
        return None
    try:
        return response.json()
    except ValueError as exc:
        raise EngineError(f"SGLang {endpoint} returned non-JSON: {response.text[:200]!r}") from exc


def _error_message(payload: Any) -> Any:
    """SGLang errors look like {"error": {"message": ...}} or {"success": false, "message": ...}."""
    if not isinstance(payload, dict):
        return payload
    err = payload.get("error")
    if isinstance(err, dict) and err.get("message"):
        return err["message"]
    return payload.get("message") or err or payload
