"""RL on an existing OpenAI-client agent: its code unchanged, its model served by the policy.

    python examples/openai_agent_rl.py                                  # SmolLM2-135M-Instruct
    python examples/openai_agent_rl.py --judge-url http://127.0.0.1:8000/v1 --judge-model qwen
    python examples/openai_agent_rl.py --tiny                           # the tiny random model, 2 steps (CI)

``calculator_agent`` is an agent as it would be written for any OpenAI-compatible server: it
opens its own MCP session to a calculator server (``python -m materl.tools.calculator`` over
stdio), shows the model the tools, runs the calls the model makes and sends the results back,
until the model answers. materl runs it once per episode through ``ml.agent_episodes`` with a
client whose ``base_url`` is a local endpoint served by the policy (127.0.0.1, a key per
episode), and trains on the exact tokens the policy sampled.

Rewards: an exact-answer check (the last number of the agent's answer against the ``answer``
column) plus an LLM judge scoring each episode against a rubric (``ml.judge``). The judge is any
OpenAI-compatible URL (``--judge-url``: a bigger model on vLLM or SGLang, say); without one, the
script serves a rule-based judge at a local URL (``rule_judge_url``: "Score: 1" when the
transcript shows a calculator call, else "Score: 0"), so it runs offline and its judge never
answers gibberish. A judge that answers without a score fails that episode (never a silent 0).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "2")

import materl as ml  # noqa: E402
from arithmetic import arithmetic_rows  # noqa: E402

SYSTEM = ('Use the calculate tool: reply with <tool_call>{"name": "calculate", "arguments": '
          '{"expression": "..."}}</tool_call>, then answer with its result.')
RUBRIC = "The assistant used the calculator for the arithmetic and stated the result as its answer."
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


async def calculator_agent(client, task):
    """An ordinary tool loop over the OpenAI client and an MCP session of its own."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    server = StdioServerParameters(command=sys.executable, args=["-m", "materl.tools.calculator"])
    async with stdio_client(server) as (read, write), ClientSession(read, write) as mcp:
        await mcp.initialize()
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}}
                 for t in (await mcp.list_tools()).tools]
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
        for _ in range(3):
            reply = (await client.chat.completions.create(model="policy", messages=messages, tools=tools)).choices[0]
            messages.append(reply.message.model_dump(exclude_none=True))
            if not reply.message.tool_calls:
                break
            for call in reply.message.tool_calls:
                result = await mcp.call_tool(call.function.name, json.loads(call.function.arguments))
                text = "".join(getattr(part, "text", "") for part in result.content)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
        return messages[-1].get("content") or ""


def exact_answer(*, rollouts, answer, **_):
    """1 if the last number of the agent's final answer equals the gold answer (commas ignored)."""
    out = []
    for r, gold in zip(rollouts, answer):
        nums = _NUMBER.findall(str(r.metadata.get("result") or ""))
        out.append(float(bool(nums) and nums[-1].replace(",", "") == str(gold)))
    return out


def agent_recipe(judge_url: str, judge_model: str, judge_key: str | None):
    @ml.recipe
    def openai_agent_grpo(policy, prompts):
        rollout = ml.agent_episodes(policy, prompts, agent=calculator_agent, name="rollout")
        rewards = (ml.reward(exact_answer, rollout=rollout, name="answer")
                   + ml.judge(RUBRIC, model=judge_url, model_name=judge_model, api_key=judge_key, rollout=rollout,
                              weight=0.2, name="judge", max_concurrency=8, timeout_s=60, retries=2))
        advantages = ml.advantages(rewards, estimator="grpo", completions=rollout)
        ml.set_loss(ml.policy_loss(advantages, ml.logprobs(policy, prompts, rollout), agg="token_mean"))

    return openai_agent_grpo


def rule_judge_url() -> str:
    """A rule-based judge behind an OpenAI-compatible URL on 127.0.0.1 (a background thread)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def chat(request):
        body = await request.json()
        called = "[calls calculate(" in body["messages"][-1]["content"]
        message = {"role": "assistant", "content": f"Score: {int(called)}"}
        return JSONResponse({"id": "rule", "object": "chat.completion", "created": 0, "model": "rule",
                             "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])]),
                                           log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the tiny random model, 2 short steps (CI)")
    p.add_argument("--judge-url", help="an OpenAI-compatible judge (default: a local rule-based one)")
    p.add_argument("--judge-model", default="judge")
    p.add_argument("--judge-key", default=os.environ.get("JUDGE_API_KEY"))
    args = p.parse_args(argv)
    steps, batch, group, tokens = (2, 2, 2, 16) if args.tiny else (12, 2, 4, 64)
    recipe = agent_recipe(args.judge_url or rule_judge_url(), args.judge_model, args.judge_key)
    policy = ml.Agent("tiny-random" if args.tiny else "smollm2-135m-instruct", trainable=True)
    step = ml.compile(recipe, policy=policy, group_size=group, max_new_tokens=tokens, lr=3e-5, temperature=0.7,
                      seed=0)
    rows = arithmetic_rows(steps * batch, seed=0)
    try:
        for i in range(steps):
            chunk = rows[i * batch:(i + 1) * batch]
            m = step.run(prompts=[r["prompt"] for r in chunk], answer=[r["answer"] for r in chunk])
            print(f"step {i}  reward {m['reward']:.3f}  answer {m['reward/answer/mean']:.2f}  "
                  f"judge {m['reward/judge/mean']:.2f}  requests/episode {m['agent/requests/mean']:.1f}  "
                  f"segments {m['agent/segments/mean']:.1f}  failed {m['failed_episodes']:.0f}  "
                  f"{m['time/step']:.1f}s", flush=True)
    finally:
        step.close()


if __name__ == "__main__":
    main()
