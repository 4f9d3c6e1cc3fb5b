"""An outage of an agent's own MCP tools (the agent runs its MCP client itself, as agent code
does) is classified and masked like the same outage through ``ml.mcp_tools``: the episode is
left out, the step is skipped with ``infra_failures/update_skipped`` = 1, and the run goes on;
never "ExceptionGroup: unhandled errors in a TaskGroup". Real MCP SDK clients against a server
that is not there (HTTP: nothing listens on the port; stdio: a server that exits at start)."""

import socket
import sys

import pytest

import materl as ml
from materl.compiler.failures import Failure, outage_kind
from materl.errors import StepFailedError


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


async def list_tools_over_http(url: str):
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with streamable_http_client(url) as (read, write, *_), ClientSession(read, write) as session:
        await session.initialize()
        return await session.list_tools()


async def list_tools_over_stdio(argv: list[str]):
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    server = StdioServerParameters(command=argv[0], args=argv[1:])
    async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        return await session.list_tools()


async def raised(coro) -> BaseException:
    try:
        await coro
    except BaseException as exc:  # noqa: BLE001 - what the SDK raises is what the agent raises
        return exc
    raise AssertionError("the MCP client reached a server that should not be there")


async def test_what_the_mcp_client_raises_for_an_outage_is_classified():
    down = await raised(list_tools_over_http(f"http://127.0.0.1:{closed_port()}/mcp"))
    assert isinstance(down, BaseExceptionGroup)  # what ended the run before
    assert outage_kind(down) == "unavailable"
    exited = await raised(list_tools_over_stdio([sys.executable, "-c", "import sys; sys.exit(3)"]))
    assert outage_kind(exited) == "crash"
    # the agent's own bugs are not outages, in a group or not
    assert outage_kind(ExceptionGroup("agent", [KeyError("answer")])) is None
    assert outage_kind(ExceptionGroup("mixed", [ConnectionRefusedError(), KeyError("answer")])) is None
    assert outage_kind(ZeroDivisionError()) is None
    # an error chained from an outage (a framework wrapping it) is one
    try:
        raise RuntimeError("could not list the tools") from down
    except RuntimeError as wrapped:
        assert outage_kind(wrapped) == "unavailable"


def test_a_failure_inside_an_exception_group_is_named_by_its_errors():
    try:
        raise ExceptionGroup("unhandled errors in a TaskGroup", [KeyError("answer")])
    except ExceptionGroup as exc:
        failure = Failure.of("rollout", exc)
    assert (failure.node, failure.kind) == ("rollout", "KeyError")
    assert failure.message == "KeyError: 'answer' (inside ExceptionGroup)"


def agent_recipe(url: str):
    async def agent(client, task):
        """Lists its tools over MCP first, as an agent with its own tool server does."""
        await list_tools_over_http(url)
        return "unreachable"

    @ml.recipe
    def agent_grpo(policy, prompts):
        rollout = ml.agent_episodes(policy, prompts, agent=agent, name="rollout")
        rewards = ml.reward("length", rollout=rollout, name="length")
        advantages = ml.advantages(rewards, estimator="grpo", completions=rollout)
        ml.set_loss(ml.policy_loss(advantages, ml.logprobs(policy, prompts, rollout), agg="token_mean"))

    return agent_grpo


@pytest.mark.parametrize("policy", ["mask", "keep"])
def test_a_step_whose_agents_lost_their_tools_is_skipped_not_ended(policy):
    step = ml.compile(agent_recipe(f"http://127.0.0.1:{closed_port()}/mcp"),
                      policy=ml.Agent("tiny-random", trainable=True), group_size=2, max_new_tokens=4,
                      infra_failures=policy, max_failed_fraction=0.5)
    try:
        if policy == "keep":  # nothing to train on: the episodes fail, and so does the step
            with pytest.raises(StepFailedError, match=r"ConnectError"):
                step.run(prompts=["a", "b"])
            return
        weights = [p.detach().clone() for p in step.agents["policy"].parameters()]
        metrics = step.run(prompts=["a", "b"])
        episodes = step.last_episodes
    finally:
        step.close()
    assert metrics["infra_failures/update_skipped"] == 1.0
    assert metrics["infra_failures/unavailable"] == 4.0 and metrics["infra_failures/episodes_masked"] == 4.0
    assert metrics["failed_episodes"] == 0.0 and metrics["masked_episodes"] == 4.0
    assert "reward" not in metrics  # no episode left to score
    assert all(e.error is None and e.infra == "unavailable" and "ConnectError" in e.excluded for e in episodes)
    assert all(torch_equal(a, b) for a, b in zip(weights, step.agents["policy"].parameters()))


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)
