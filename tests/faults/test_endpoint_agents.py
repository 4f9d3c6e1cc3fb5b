"""Agent code that misbehaves around the endpoint, for real: an ``async def`` agent that calls a
synchronous OpenAI client (it holds the event loop that serves its own request) is reported at
once, naming the agent and the line; and ``ml.train`` then ``step.close()`` leaves no agent
endpoint running (the in-process rollout worker stops what it started)."""

import gc
import logging
import socket

import httpx
import openai

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.options import CompileOptions
from materl.runtime.train import train

SHARED = httpx.Client()  # built here, not in the agent: building one loads the CA store (slow)
BLOCKING_LINE = []


async def blocking_agent(client, task):
    """Existing sync code pasted into ``async def``: the synchronous client blocks the event loop."""
    sync = openai.OpenAI(base_url=str(client.base_url), api_key=client.api_key, max_retries=0, timeout=4,
                         http_client=SHARED)
    import inspect

    BLOCKING_LINE.append(inspect.currentframe().f_lineno + 1)
    out = sync.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["prompt"]}])
    return out.choices[0].message.content


@ml.recipe
def blocking(policy, prompts):
    ml.agent_episodes(policy, prompts, agent=blocking_agent, name="rollout")


async def test_an_async_agent_holding_the_event_loop_is_reported_at_once(caplog):
    compiled = Compiled(blocking, {"policy": ml.Agent("tiny-random")},
                        CompileOptions(group_size=1, max_new_tokens=4, max_failed_fraction=1.0), rollout_only=True)
    endpoint = compiled.service("rollout")  # the live endpoint the step built from the recipe's spec
    endpoint.watch.after_s = 0.5
    with caplog.at_level(logging.ERROR, logger="materl"):
        try:
            (episode,) = await compiled.rollout(["hi"])
        finally:
            await compiled.aclose()
    # the request could not be answered while the agent held the loop: its client timed out
    assert episode.error is not None and episode.error.kind == "APITimeoutError"
    (message,) = endpoint.watch.reported
    assert "agent 'blocking_agent' has held the event loop" in message
    assert f"test_endpoint_agents.py:{BLOCKING_LINE[0]}" in message  # the blocking line
    assert "plain `def`" in message
    (record,) = [r for r in caplog.records if "held the event loop" in r.getMessage()]
    assert record.threadName == "materl-loop-watch"  # said by the watch while the loop was held


async def ask(client, task):
    out = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["prompt"]}])
    return out.choices[0].message.content


@ml.recipe
def agent_grpo(policy, prompts):
    rollout = ml.agent_episodes(policy, prompts, agent=ask, name="rollout")
    rewards = ml.reward(lambda completions, **_: [float(len(c)) for c in completions], rollout=rollout)
    advantages = ml.advantages(rewards, estimator="grpo", completions=rollout)
    ml.set_loss(ml.policy_loss(advantages, ml.logprobs(policy, prompts, rollout)))


def test_train_then_close_leaves_no_agent_endpoint_running(tmp_path, caplog, capfd):
    step = ml.compile(agent_grpo, policy=ml.Agent("tiny-random", trainable=True), group_size=2, max_new_tokens=4,
                      lr=1e-3, max_staleness=1)  # the in-process worker samples with a copy and starts the endpoint
    endpoint = step.service("rollout")
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        try:
            out = train(step, [{"prompt": "a"}, {"prompt": "b"}], steps=2, batch_size=1, run_dir=tmp_path,
                        progress=False, tensorboard=False)
        finally:
            step.close()
        gc.collect()
    assert len(out["history"]) == 2 and endpoint.port is not None
    assert not endpoint.started
    with socket.socket() as probe:  # nothing listens on its port any more
        assert probe.connect_ex(("127.0.0.1", endpoint.port)) != 0
    assert not [r for r in caplog.records if "Task was destroyed" in r.getMessage()]
    assert "Task was destroyed" not in capfd.readouterr().err
