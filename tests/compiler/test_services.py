"""A recipe holds service specs, never live services: the compiled step builds its own endpoint and
judges from them (``materl.compiler.services``), starts them with its rollout and closes them in
``close()``: the agent endpoint stops listening and a URL judge's connection pools close. Against
a real judge server (starlette on uvicorn, 127.0.0.1) and the real endpoint, seen from the
process's own TCP connections."""

import pickle
import socket

import psutil

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.options import CompileOptions
from materl.compiler.spec import OPS
from materl.rollout.endpoint import AgentEndpoint, EndpointSpec
from materl.rollout.judge import Judge, JudgeSpec
from materl.rollout.principles import PrincipleJudge, PrinciplesSpec
from materl.rollout.services import EpisodeService
from tests.faults.judge_server import JudgeServer, chat

RUBRIC = "Is the answer right?"


async def ask(client, task):
    out = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["prompt"]}])
    return out.choices[0].message.content


def judged_agent(url: str):
    @ml.recipe
    def judged_agent_recipe(policy, prompts):
        rollout = ml.agent_episodes(policy, prompts, agent=ask, name="rollout")
        ml.judge(RUBRIC, model=url, rollout=rollout, name="judge") \
            + ml.judge(principles=["Be brief.", "Be right."], model=url, rollout=rollout, name="principles")
    return judged_agent_recipe


def rollout_step(recipe) -> Compiled:
    return Compiled(recipe, {"policy": ml.Agent("tiny-random")},
                    CompileOptions(group_size=2, max_new_tokens=4, max_failed_fraction=0.0), rollout_only=True)


def established_to(port: int) -> list:
    """This process's open TCP connections to ``port`` (the client side)."""
    return [c for c in psutil.Process().net_connections(kind="tcp")
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED]


def test_the_op_table_names_the_params_that_hold_services():
    assert {k: OPS.get(k).services for k in ("generate_step", "call_tools", "agent_episodes", "judge", "principles",
                                             "generate", "rewards")} == {
        "generate_step": ("tools",), "call_tools": ("tools",), "agent_episodes": ("endpoint",), "judge": ("judge",),
        "principles": ("principles",), "generate": (), "rewards": ()}


def test_a_recipe_holds_picklable_specs_and_each_compiled_step_builds_its_own_services():
    recipe = judged_agent("http://127.0.0.1:9/v1")  # nothing listens there: nothing is started here
    specs = {name: recipe.node(name).params[param]
             for name, param in (("rollout", "endpoint"), ("judge", "judge"), ("principles", "principles"))}
    assert [type(s) for s in specs.values()] == [EndpointSpec, JudgeSpec, PrinciplesSpec]
    assert not any(isinstance(s, EpisodeService) for s in specs.values())  # nothing to start or close
    again = pickle.loads(pickle.dumps(recipe))
    assert {n: again.node(n).params[p] for n, p in (("rollout", "endpoint"), ("judge", "judge"),
                                                     ("principles", "principles"))} == specs
    assert str(again) == str(recipe)

    first, second = rollout_step(recipe), rollout_step(recipe)
    for name, kind in (("rollout", AgentEndpoint), ("judge", Judge), ("principles", PrincipleJudge)):
        a, b = first.service(name), second.service(name)
        assert isinstance(a, kind) and isinstance(b, kind) and a is not b and not a.started
    assert first.service("judge").rubric == RUBRIC and first.service("judge").model == "http://127.0.0.1:9/v1"
    assert list(first.service("principles").judges) == ["p1", "p2"]


def test_closing_the_step_closes_the_endpoint_and_the_judges_connection_pools():
    with JudgeServer(lambda k, body: chat("Score: 0.5"), keep_alive_s=600) as server:
        judge_port = int(server.url.split(":")[2].split("/")[0])
        step = rollout_step(judged_agent(server.url))
        try:
            episodes = step.call_blocking(step.rollout, ["What is 2+3?", "Say hi."])
            endpoint = step.service("rollout")
            assert [e.error for e in episodes] == [None] * 4 and [e.values["judge"] for e in episodes] == [0.5] * 4
            # 4 rubric calls and 2 principles x 4 episodes, on the judges' kept-alive connections
            assert len(server.requests) == 12 and established_to(judge_port)
            assert endpoint.started and all(step.service(n).started for n in ("judge", "principles"))
        finally:
            step.close()
        assert not established_to(judge_port)  # every pool of the three judges closed its connections
        assert not endpoint.started and not established_to(endpoint.port)
        with socket.socket() as probe:  # nothing listens on the endpoint's port any more
            assert probe.connect_ex(("127.0.0.1", endpoint.port)) != 0
        assert not any(step.service(n).started for n in ("judge", "principles"))
