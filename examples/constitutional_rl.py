"""Principle-based AI feedback (Constitutional AI / RLAIF): a judge scores every episode against
each written principle; the policy learns from the aggregate, and from the judge's revisions.

    python examples/constitutional_rl.py                              # SmolLM2-135M-Instruct, rule judge
    python examples/constitutional_rl.py --judge-url http://127.0.0.1:8000/v1 --judge-model qwen
    python examples/constitutional_rl.py --tiny                       # the tiny random model, 2 steps (CI)

Each step: GRPO on ``ml.judge(principles=PRINCIPLES, revise="prefer")``, the judge first
critiquing each answer against all principles and writing a revision, then scoring the answer
against each principle (each principle's mean score is a metric: ``reward/principles/<name>/mean``);
then one DPO step on the (prompt, chosen = revision, rejected = answer) pairs the revisions made
(``materl.rollout.principles.preference_pairs`` with ``materl.recipes.dpo``).

The judge is any OpenAI-compatible URL (``--judge-url``); without one the script serves a
rule-based judge on 127.0.0.1 (``rule_judge_url``) that applies the principles literally:
"brief" scores 1 for at most 12 words (else 12 / words), "polite" 1 when the answer says please
or thanks, and its revision keeps the first 12 words and adds "Thanks!". It runs offline and
never answers gibberish; a model judge that answers without a score fails that episode.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "2")

import materl as ml  # noqa: E402
from materl.recipes import dpo  # noqa: E402
from materl.rollout.principles import preference_pairs  # noqa: E402

PRINCIPLES = [{"name": "brief", "text": "Answer in at most 12 words."},
              {"name": "polite", "text": "Be polite: say please or thanks."}]
QUESTIONS = ["How do I boil an egg?", "What is the capital of France?", "Why is the sky blue?",
             "How do I water a cactus?", "What should I pack for a hike?", "How do I say hello in Spanish?"]


def constitutional_recipe(judge_url: str, judge_model: str = "judge", api_key: str | None = None):
    @ml.recipe
    def constitutional(policy, ref_policy, prompts):
        completions = ml.generate(policy, prompts, name="completions")
        policy_logprobs = ml.logprobs(policy, prompts, completions, name="policy_logprobs")
        ref_logprobs = ml.logprobs(ref_policy, prompts, completions, name="ref_logprobs")
        rewards = ml.judge(principles=PRINCIPLES, model=judge_url, model_name=judge_model, api_key=api_key,
                           revise="prefer", aggregate="mean", name="principles")
        advantages = ml.advantages(rewards, name="advantages")
        ml.set_loss(ml.grpo_loss(advantages, policy_logprobs, ref_logprobs))

    return constitutional


def rule_answer(system: str, user: str) -> str:
    """The rule judge: a principle's score, or a critique and revision."""
    response = user.split("<response>\n", 1)[-1].split("\n</response>", 1)[0]  # the judge's delimited response
    response = response.removeprefix("[assistant] ")  # the judge's transcript marks the turn
    words = response.split()
    if "rewrite it" in system:  # the critique-then-revise request
        return f"Too long or curt.\nRevision: {' '.join(words[:12])} Thanks!"
    if "12 words" in system:
        return f"Score: {min(1.0, 12 / max(1, len(words))):.3f}"
    return f"Score: {int(bool(re.search(r'please|thank', response, re.I)))}"


def rule_judge_url() -> str:
    """The rule judge behind an OpenAI-compatible URL on 127.0.0.1 (a background thread)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def chat(request):
        messages = (await request.json())["messages"]
        message = {"role": "assistant", "content": rule_answer(messages[0]["content"], messages[-1]["content"])}
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
    steps, tokens, name = (2, 12, "tiny-random") if args.tiny else (8, 48, "smollm2-135m-instruct")
    policy, ref = ml.Agent(name, trainable=True), ml.Agent(name)
    recipe = constitutional_recipe(args.judge_url or rule_judge_url(), args.judge_model, args.judge_key)
    rl = ml.compile(recipe, policy=policy, ref_policy=ref, group_size=4, max_new_tokens=tokens, lr=1e-5,
                    temperature=0.8, seed=0)
    prefer = ml.compile(dpo, policy=policy, ref_policy=ref, lr=1e-5, seed=0)
    try:
        for i in range(steps):
            m = rl.run(prompts=[QUESTIONS[(2 * i + k) % len(QUESTIONS)] for k in range(2)])
            pairs = preference_pairs([ep.values["completions"] for ep in rl.last_episodes])
            d = prefer.run(pairs=pairs) if pairs else {"loss": float("nan")}
            print(f"step {i} reward {m['reward']:.3f} brief {m['reward/principles/brief/mean']:.3f} "
                  f"polite {m['reward/principles/polite/mean']:.3f} failed {m['failed_episodes']:.0f} "
                  f"pairs {len(pairs)} dpo_loss {d['loss']:.4f}", flush=True)
    finally:
        rl.close()
        prefer.close()


if __name__ == "__main__":
    main()
