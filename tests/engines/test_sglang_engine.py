"""SGLangEngine against a fake server (httpx.MockTransport): the requests it sends and how it
reads SGLang's native /generate responses. The live-server contract is in
test_engine_contract.py (MATERL_SGLANG_URL)."""

import json

import httpx
import pytest

from materl.engines.base import SamplingParams
from materl.engines.sglang_engine import SGLangEngine, parse_generation, request_body
from materl.errors import ConfigError, EngineError

# What SGLang's /generate returns for return_logprob=True: one [logprob, token_id, text|None]
# per output token in meta_info.output_token_logprobs.
RESPONSE = {
    "text": "Hi!<|im_end|>",
    "output_ids": [12, 34, 2],
    "meta_info": {
        "id": "abc",
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "finish_reason": {"type": "stop", "matched": 2},
        "output_token_logprobs": [[-0.5, 12, None], [-1.25, 34, None], [-0.01, 2, None]],
    },
}


def fake_server(log, response=RESPONSE, status=200):
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        log.append((request.url.path, body))
        return httpx.Response(status, json=response)

    return httpx.MockTransport(handler)


async def test_generate_sends_ids_and_reads_exact_ids_and_logprobs():
    log = []
    engine = SGLangEngine("http://sglang:30000/", transport=fake_server(log))
    params = SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=0,
                            stop_strings=("</tool_call>",), stop_token_ids=(7,), seed=11)
    gen = await engine.generate([1, 2, 3], params)
    await engine.aclose()
    path, body = log[0]
    assert path == "/generate"
    assert body["input_ids"] == [1, 2, 3] and body["return_logprob"] is True
    assert body["sampling_params"] == {
        "max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": -1,  # 0 (off) -> SGLang's -1
        "stop": ["</tool_call>"], "stop_token_ids": [7], "no_stop_trim": True,
        "skip_special_tokens": False, "sampling_seed": 11,
    }
    assert gen.token_ids == [12, 34, 2] and gen.logprobs == [-0.5, -1.25, -0.01]
    assert gen.finish_reason == "stop" and gen.prompt_len == 3 and gen.metadata["text"] == "Hi!<|im_end|>"


def test_greedy_is_temperature_zero():
    body = request_body([1], SamplingParams(greedy=True, temperature=0.7))
    assert body["sampling_params"]["temperature"] == 0.0 and "sampling_seed" not in body["sampling_params"]


@pytest.mark.parametrize("finish,expected", [
    ({"type": "length", "length": 3}, "length"),
    ({"type": "stop", "matched": "</tool_call>"}, "stop_string"),
    ({"type": "stop", "matched": 2}, "stop"),
])
def test_finish_reasons(finish, expected):
    data = {**RESPONSE, "meta_info": {**RESPONSE["meta_info"], "finish_reason": finish}}
    assert parse_generation(data, prompt_len=3).finish_reason == expected


def test_dict_shaped_logprob_entries_and_missing_logprobs():
    meta = {"finish_reason": {"type": "length"},
            "output_token_logprobs": [{"logprob": -2.0, "token_id": 9}]}
    gen = parse_generation({"text": "x", "meta_info": meta}, prompt_len=1)
    assert gen.token_ids == [9] and gen.logprobs == [-2.0]
    with pytest.raises(EngineError, match="output_token_logprobs"):
        parse_generation({"text": "x", "meta_info": {}}, prompt_len=1)


async def test_server_errors_carry_the_server_message():
    log = []
    engine = SGLangEngine("http://sglang:30000", transport=fake_server(
        log, {"error": {"message": "input is longer than the context length"}}, status=400))
    with pytest.raises(EngineError, match="HTTP 400: input is longer than the context length"):
        await engine.generate([1], SamplingParams())
    await engine.aclose()


def test_sync_weights_saves_then_updates_then_flushes(tmp_path):
    log, saved = [], []
    engine = SGLangEngine("http://sglang:30000", model_path=tmp_path, export_weights=saved.append,
                          sync_transport=fake_server(log, {"success": True, "message": "ok"}))
    engine.sync_weights()
    assert saved == [str(tmp_path)]
    assert log == [("/update_weights_from_disk", {"model_path": str(tmp_path)}), ("/flush_cache", None)]


def test_sync_weights_failure_and_missing_exporter(tmp_path):
    engine = SGLangEngine("http://sglang:30000", model_path=tmp_path, export_weights=lambda _: None,
                          sync_transport=fake_server([], {"success": False, "message": "shape mismatch"}))
    with pytest.raises(EngineError, match="shape mismatch"):
        engine.sync_weights()
    with pytest.raises(EngineError, match="export_weights"):
        SGLangEngine("http://sglang:30000").sync_weights()


def test_url_is_required(monkeypatch):
    monkeypatch.delenv("MATERL_SGLANG_URL", raising=False)
    with pytest.raises(ConfigError, match="MATERL_SGLANG_URL"):
        SGLangEngine()
