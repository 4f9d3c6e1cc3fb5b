"""Single-turn: verifiers' docs' addition taskset ("Building Tasksets"), with a second reward."""

import verifiers.v1 as vf


class AdditionData(vf.TaskData):
    answer: int


class AdditionTask(vf.Task[AdditionData]):
    @vf.reward
    async def exact_match(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == str(self.data.answer))

    @vf.reward(weight=0.5)
    async def brevity(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) <= 4)


class AdditionConfig(vf.TasksetConfig):
    num_tasks: int = 100


class AdditionTaskset(vf.Taskset[AdditionTask, AdditionConfig]):
    def load(self) -> list[AdditionTask]:
        return [
            AdditionTask(AdditionData(idx=i, prompt=f"What is {i} + {i}?", answer=2 * i), self.config.task)
            for i in range(self.config.num_tasks)
        ]


__all__ = ["AdditionTaskset"]
