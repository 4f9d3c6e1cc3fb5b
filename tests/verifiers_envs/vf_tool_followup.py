"""Multi-turn with a tool: a Toolset served over MCP to the harness (verifiers' docs' "Adding
Tools"), and an Env whose ``run`` is the rollout loop: the task's prompt, then a follow-up user
turn in the same conversation (verifiers' docs' "The Env", ``agents.agent.interaction``)."""

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == str(self.data.answer))

    @vf.reward(weight=0.2)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(any(str(self.data.answer) in str(m.content) for m in trace.tool_messages))


class CalculatorTools(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class SumConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        return [SumTask(SumData(idx=i, prompt=f"Use the add tool: what is {i} + 7?", answer=i + 7), self.config.task)
                for i in range(3)]

    @classmethod
    def toolsets(cls, config: SumConfig) -> list[vf.Toolset]:
        return [CalculatorTools(config.tools)]


class CheckAgainEnv(vf.SingleAgentEnv):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as chat:
            await chat.turn()
            await chat.turn("Check your answer and state it again.")


__all__ = ["SumTaskset", "CheckAgainEnv"]


if __name__ == "__main__":  # verifiers starts the toolset's MCP server as `python -m <its module>`
    CalculatorTools.run()
