"""The verifiers side of ``ml.VerifiersEnv``: run by path with the Python of a virtual
environment that has ``verifiers`` (never materl; this file imports only the standard library
and verifiers). verifiers 0.4.0 pins ``mcp==2.0.0`` and ``openai<3``, which materl's pins do not
fit, so its environments run here, in their own process.

Protocol, one JSON object per line; logs go to stderr:

- argv[1]: ``{"config": <verifiers EnvConfig data>, "num_tasks": int | null}``;
- first line out: ``{"type": "ready", "tasks": [...], "rewards": {name: weight}}`` (each task:
  ``{"idx", "prompt", "system_prompt"}``, the prompt a string or chat messages);
- in: ``{"id", "task", "base_url", "api_key", "model"}``: run one episode of task number ``task``
  with its model requests sent to ``base_url`` under ``api_key``; out: ``{"type": "episode",
  "id", "ok", "rewards": {name: score}, "metrics": {name: value}, "errors": [str], "reply"}``;
- stdin closed: stop serving and exit.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys


def _prompt(data) -> str | list:
    prompt = data.prompt
    if prompt is None or isinstance(prompt, str):
        return prompt
    return [m.model_dump(mode="json", exclude_none=True) if hasattr(m, "model_dump") else m for m in prompt]


def _declared_rewards(task) -> dict[str, float]:
    out = {fn.__name__: float(getattr(fn, "_vf_weight", 1.0)) for fn in task.hooks("reward")}
    for judge in task.plugged_judges():
        out[judge.reward_name] = float(judge.config.weight)
    return out


async def _episode(env, tasks, request: dict) -> dict:
    from verifiers.v1.clients import EvalClientConfig, ModelContext

    var = f"MATERL_VERIFIERS_KEY_{request['id']}".replace("-", "_")
    os.environ[var] = request["api_key"]  # verifiers reads the API key from a variable
    try:
        ctx = ModelContext(model=request["model"],
                           client=EvalClientConfig(base_url=request["base_url"], api_key_var=var))
        episode = await env.run_episode(tasks[request["task"]], ctx)
    finally:
        os.environ.pop(var, None)
    errors = [f"{e.type}: {e.message}" if hasattr(e, "message") else str(e) for e in episode.errors]
    traces = [t for t in episode.traces if getattr(t.agent, "trainable", True) is not False]
    if len(traces) != 1:
        errors.append(f"the episode has {len(traces)} trainable agent traces; materl trains environments "
                      f"with one (single-agent) seat")
        return {"type": "episode", "id": request["id"], "ok": False, "errors": errors}
    trace = traces[0]
    errors += [f"{e.type}: {getattr(e, 'message', '')}" for e in trace.errors]
    return {"type": "episode", "id": request["id"], "ok": bool(episode.ok and trace.ok),
            "rewards": {k: (None if r is None else r.score) for k, r in trace.rewards.items()},
            "metrics": {k: v for k, v in trace.metrics.items() if v is not None},
            "errors": errors, "reply": trace.last_reply, "turns": trace.num_turns}


def _write(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _serve(spec: dict) -> None:
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    env = load_environment(resolve_env_config(spec["config"]))
    taskset = env.taskset if spec.get("num_tasks") is None else env.taskset.take(spec["num_tasks"])
    if not taskset.bounded:
        raise ValueError(f"taskset {spec['config']['taskset']['id']!r} is infinite; give num_tasks")
    tasks = list(taskset)
    if not tasks:
        raise ValueError(f"taskset {spec['config']['taskset']['id']!r} has no tasks")
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with env.serving():
        _write({"type": "ready", "rewards": _declared_rewards(tasks[0]),
                "tasks": [{"idx": t.data.idx, "prompt": _prompt(t.data), "system_prompt": t.data.system_prompt}
                          for t in tasks]})
        running: set[asyncio.Task] = set()

        async def answer(request: dict) -> None:
            try:
                _write(await _episode(env, tasks, request))
            except Exception as e:  # noqa: BLE001 - every failure is answered, the worker goes on
                _write({"type": "episode", "id": request["id"], "ok": False, "errors": [f"{type(e).__name__}: {e}"]})

        while line := await reader.readline():
            job = asyncio.create_task(answer(json.loads(line)))
            running.add(job)
            job.add_done_callback(running.discard)
        for job in list(running):
            job.cancel()


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        asyncio.run(_serve(spec))
    except Exception as e:  # noqa: BLE001 - reported to materl as the worker's failure
        _write({"type": "error", "error": f"{type(e).__name__}: {e}"})
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
