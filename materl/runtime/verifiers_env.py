"""verifiers environments trained through ``ml.agent_episodes``' OpenAI-compatible endpoint.

    python = make_venv(".venvs/verifiers")            # its own venv: verifiers 0.4.0 (+ uv)
    env = ml.VerifiersEnv("my_taskset", python=python, path=["envs"])
    rows = env.rows()                                  # the taskset's tasks as dataset rows
    rollout = ml.agent_episodes(policy, prompts, agent=env.agent)
    rewards = env.rewards(rollout=rollout)            # each @vf.reward: reward/<name> in metrics

verifiers (Prime Intellect's environment library, 0.4.0: ``verifiers.v1``, a ``Taskset`` of
``Task`` s whose ``@vf.reward`` methods score a trace, a harness program that runs the model
loop with the taskset's MCP toolsets, an ``Env`` whose ``run`` drives the turns) pins
``mcp==2.0.0`` and ``openai<3``; earlier releases pin ``mcp<2``. materl needs ``mcp>=2`` and pins
openai 3 / openai-agents 0.24, so no release fits in materl's process. The environment runs
unchanged in a worker process of its own virtual environment (``verifiers_worker.py``): per
episode materl sends it the task number and the episode's endpoint URL and key; verifiers runs
its own episode (harness, tools, turns, scoring) with its model requests going to that URL, and
answers the trace's rewards by episode id. The endpoint records the ids the policy sampled, so
the tokens trained are exactly the sampled ones (docs/agents.md, "Exact tokens").
(prime-rl trains the same environments through its vLLM server and verifiers' ``TrainClient``;
materl's endpoint stands in for that server.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from materl.errors import ConfigError, EpisodeError

VERIFIERS_VERSION = "0.4.0"
WORKER = Path(__file__).with_name("verifiers_worker.py")
TASK_COLUMN = "vf_task"


def make_venv(path: str | os.PathLike, *, verifiers: str = VERIFIERS_VERSION) -> str:
    """A virtual environment at ``path`` with ``verifiers==<verifiers>`` and ``uv`` (the verifiers
    harnesses build their programs' environments with uv), made with uv from the package index;
    kept when it already has that version. Returns its Python."""
    path = Path(path)
    python = path / "bin" / "python"
    marker = path / f".materl-verifiers-{verifiers}"
    if python.exists() and marker.exists():
        return str(python)
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(uv).exists() and shutil.which(uv) is None:
        raise ConfigError("making a verifiers venv needs uv; install materl's verifiers extra "
                          "(pip install -c constraints.txt -e '.[verifiers]')")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for cmd in ([uv, "venv", "-q", "--allow-existing", "--python", version, str(path)],
                [uv, "pip", "install", "-q", "--python", str(python), f"verifiers=={verifiers}", "uv"]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise ConfigError(f"making the verifiers venv at {path}: {' '.join(cmd)} failed: {done.stderr[-2000:]}")
    marker.touch()
    return str(python)


class VerifiersEnv:
    """A verifiers environment (taskset id ``taskset``: the module exporting its ``Taskset``, and
    an ``Env`` subclass if it has one) run by ``python``, the Python of a venv with verifiers
    (``make_venv``). ``options``: the taskset config's fields; ``config``: more of verifiers'
    env config (``[env]`` in its TOML), merged over materl's defaults (the ``null`` harness,
    verifiers' plain chat loop with MCP tools, in the ``subprocess`` runtime); ``num_tasks``:
    the first that many tasks (required for an infinite taskset); ``path``: folders the
    environment's modules are imported from (added to PYTHONPATH). The worker starts on first
    use and stops with ``close()``."""

    def __init__(self, taskset: str, *, python: str | os.PathLike, options: Mapping[str, Any] | None = None,
                 config: Mapping[str, Any] | None = None, harness: str = "null", runtime: str = "subprocess",
                 num_tasks: int | None = None, path: Sequence[str | os.PathLike] = (), model: str = "policy",
                 start_timeout_s: float = 600.0):
        if not isinstance(taskset, str) or not taskset:
            raise ConfigError(f"ml.VerifiersEnv(taskset={taskset!r}); accepted: a verifiers taskset id (the module "
                              f"that exports its Taskset)")
        if not Path(python).is_file():
            raise ConfigError(f"ml.VerifiersEnv(python={str(python)!r}): no such file; accepted: the Python of a venv "
                              f"with verifiers=={VERIFIERS_VERSION}, e.g. "
                              f"materl.runtime.verifiers_env.make_venv('.venvs/verifiers')")
        if num_tasks is not None and (not isinstance(num_tasks, int) or isinstance(num_tasks, bool) or num_tasks < 1):
            raise ConfigError(f"ml.VerifiersEnv(num_tasks={num_tasks!r}); accepted: a positive int or None (all)")
        defaults = {"taskset": {"id": taskset, **dict(options or {})},
                    "agent": {"harness": {"id": harness}, "runtime": {"type": runtime}}}
        self.taskset, self.python, self.model = taskset, str(python), model
        self.spec = {"config": _merge(defaults, dict(config or {})), "num_tasks": num_tasks}
        self.path = [str(Path(p).resolve()) for p in path]
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._ready: dict | None = None
        self._pending: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._stderr = None

    # -- the worker ------------------------------------------------------------------------------

    def _start(self) -> dict:
        with self._lock:
            if self._ready is not None:
                return self._ready
            env = dict(os.environ)
            bin_dir = str(Path(self.python).parent)
            env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
            env["PYTHONPATH"] = os.pathsep.join([*self.path, *filter(None, [env.get("PYTHONPATH")])])
            env.pop("VIRTUAL_ENV", None)
            self._stderr = tempfile.TemporaryFile(mode="w+")
            # run by path but without its folder on sys.path (materl/runtime/logging.py would shadow logging)
            code = f"import runpy; runpy.run_path({str(WORKER)!r}, run_name='__main__')"
            self._proc = subprocess.Popen([self.python, "-c", code, json.dumps(self.spec)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env)
            weakref.finalize(self, _stop, self._proc)
            first = concurrent.futures.Future()
            threading.Thread(target=self._read, args=(first,), daemon=True, name="verifiers-worker").start()
            try:
                ready = first.result(timeout=self.start_timeout_s)
            except concurrent.futures.TimeoutError:
                _stop(self._proc)
                raise EpisodeError(f"verifiers environment {self.taskset!r} did not start within "
                                   f"{self.start_timeout_s:g} s{self._tail()}") from None
            if ready.get("type") != "ready":
                _stop(self._proc)
                raise ConfigError(f"verifiers environment {self.taskset!r} failed to load: "
                                  f"{ready.get('error', ready)}{self._tail()}")
            self._ready = ready
            return ready

    def _read(self, first: concurrent.futures.Future) -> None:
        for line in self._proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:  # a stray print in the environment's code
                continue
            if not first.done():
                first.set_result(msg)
                continue
            fut = self._pending.pop(msg.get("id"), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        gone = {"type": "error", "error": f"the verifiers worker exited (code {self._proc.wait()}){self._tail()}"}
        if not first.done():
            first.set_result(gone)
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_result({"ok": False, "errors": [gone["error"]]})

    def _tail(self) -> str:
        if self._stderr is None:
            return ""
        try:
            self._stderr.seek(0)
            text = self._stderr.read()[-3000:]
        except (OSError, ValueError):
            return ""
        return f"; its stderr ends: {text}" if text.strip() else ""

    def close(self) -> None:
        """Stop the worker (verifiers' tool servers and interception with it)."""
        if self._proc is not None:
            _stop(self._proc)
        self._proc, self._ready = None, None

    def __enter__(self) -> VerifiersEnv:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- dataset, agent, rewards ----------------------------------------------------------------

    def rows(self) -> list[dict]:
        """The taskset's tasks as dataset rows: ``{"prompt": the task's prompt (its system prompt
        first, as chat messages, when it has one), "vf_task": its number}``. The prompt is what
        materl groups and shows; verifiers' harness builds the model's messages itself."""
        out = []
        for i, task in enumerate(self._start()["tasks"]):
            prompt = task["prompt"] if task["prompt"] is not None else f"(verifiers task {task['idx']})"
            if task.get("system_prompt"):
                user = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
                prompt = [{"role": "system", "content": task["system_prompt"]}, *user]
            out.append({"prompt": prompt, TASK_COLUMN: i})
        return out

    @property
    def reward_weights(self) -> dict[str, float]:
        """Each reward of the environment's tasks (``@vf.reward`` methods, plugged rewards and
        judges) and its weight."""
        return dict(self._start()["rewards"])

    async def agent(self, client, task: Mapping[str, Any]) -> dict:
        """``ml.agent_episodes``' agent: runs verifiers' own episode of the row's task with its
        model requests sent to ``client``'s endpoint and key; returns ``{"rewards": {name: score},
        "metrics", "reply", "turns"}`` (the episode's result)."""
        if TASK_COLUMN not in task:
            raise ConfigError(f"VerifiersEnv.agent: the row has no {TASK_COLUMN!r} column (columns: "
                              f"{sorted(task)}); train on env.rows()")
        ready = self._start()
        index = task[TASK_COLUMN]
        if not isinstance(index, int) or not 0 <= index < len(ready["tasks"]):
            raise ConfigError(f"VerifiersEnv.agent: {TASK_COLUMN}={index!r}; accepted: 0..{len(ready['tasks']) - 1}")
        episode_id = uuid.uuid4().hex
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._pending[episode_id] = fut
        request = {"id": episode_id, "task": index, "base_url": str(client.base_url).rstrip("/"),
                   "api_key": client.api_key, "model": self.model}
        with self._lock:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        try:
            answer = await asyncio.wrap_future(fut)
        finally:
            self._pending.pop(episode_id, None)
        if not answer.get("ok"):
            raise EpisodeError(f"verifiers episode of task {index} failed: {'; '.join(answer.get('errors') or [])}")
        missing = sorted(k for k in ready["rewards"] if answer["rewards"].get(k) is None)
        if missing:
            raise EpisodeError(f"verifiers episode of task {index} has no score for {missing}")
        return {k: answer[k] for k in ("rewards", "metrics", "reply", "turns")}

    def rewards(self, *, rollout=None):
        """The environment's rewards as recipe reward terms, one per reward, each named by its
        function (``reward/<name>`` in metrics) and weighted as verifiers weighs it, so their
        sum is verifiers' ``trace.reward``."""
        from materl.graph.constructors import reward

        terms = [reward(verifiers_score, rollout=rollout, name=name, weight=weight, key=name)
                 for name, weight in self.reward_weights.items()]
        if not terms:
            raise ConfigError(f"verifiers environment {self.taskset!r} declares no reward (no @vf.reward method, "
                              f"plugged reward or judge)")
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        return total

    def __repr__(self) -> str:
        return f"VerifiersEnv({self.taskset!r})"


def verifiers_score(*, rollouts: Sequence, key: str, **_: Any) -> list[float]:
    """The score of reward ``key`` that verifiers gave each episode (0 for an episode scored
    without a result, i.e. one that ended in the model's mistake)."""
    out = []
    for rollout in rollouts:
        result = rollout.metadata.get("result")
        out.append(0.0 if result is None else float(result["rewards"][key]))
    return out


def _merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        proc.stdin.close()
        proc.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
