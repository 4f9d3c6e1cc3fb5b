"""Python sandbox MCP server: one tool, ``run_python(code, timeout_s=5)``.

    python -m materl.tools.python_sandbox [--memory-mb 512] [--max-timeout 30] [--max-processes 8] [--http PORT]

Each call runs ``code`` as ``main.py`` in a fresh sandbox sealed by the operating system
(``materl.tools._sandbox``: mount, PID and network namespaces, an unprivileged uid of its own,
read-only mounts, rlimits; ``_sandbox_init.py`` builds it) and returns its exit status,
stdout and stderr (each cut to 8,000 characters). A program that does not exit 0 comes back
as a tool error.

Inside, the program sees the Python installation, the server's site-packages (numpy, sympy...),
``/usr`` and an empty writable ``/work`` (its working directory and ``/tmp``; 64 MiB, gone
after the run). It may start subprocesses and threads (up to ``--max-processes`` in all); when
the run ends, every process it started is killed. It has no network (sockets other than
AF_UNIX are refused), sees no host process, no ``/proc`` (so no host path), no home directory
and no host configuration, and cannot write anywhere but ``/work`` and a 16 MiB ``/dev/shm``;
memfd and SysV shared memory are refused, so its memory stays within the limits. Where the
kernel refuses to build the sandbox, every call answers with an error saying so; nothing runs
unsealed. verl counterpart: ``verl.tools.sandbox_fusion_tools`` (a remote sandbox service).
"""

from __future__ import annotations

import asyncio
import math
import signal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

try:
    from materl.tools._sandbox import Limits, Outcome, run_sealed
    from materl.tools._serve import parser as _parser, serve as _serve
except ImportError:  # pragma: no cover - run as a plain script from a checkout
    from _sandbox import Limits, Outcome, run_sealed  # type: ignore[no-redef]
    from _serve import parser as _parser, serve as _serve  # type: ignore[no-redef]

LIMITS = Limits()
MAX_PARALLEL = 4


async def run_code(code: str, timeout_s: float, limits: Limits = LIMITS) -> tuple[str, bool]:
    """Run ``code`` in the sandbox; returns (report text, ok) where ok means exit status 0."""
    if len(code) > limits.max_code_chars:
        return f"code has {len(code)} characters; the limit is {limits.max_code_chars}", False
    timeout_s = float(timeout_s) if math.isfinite(float(timeout_s)) else 5.0
    timeout_s = min(max(timeout_s, 0.1), limits.max_timeout_s)
    return report(await run_sealed(code, timeout_s, limits), timeout_s, limits)


def report(outcome: Outcome, timeout_s: float, limits: Limits) -> tuple[str, bool]:
    status = outcome.status
    if outcome.killed is not None:
        line = f"killed: {outcome.killed}"
    elif "error" in status:
        return f"sandbox error: {status['error']}", False
    elif "signal" in status:
        name = signal.Signals(status["signal"]).name if status["signal"] in signal.Signals._value2member_map_ \
            else str(status["signal"])
        why = f" (CPU time limit of {int(timeout_s) + 1} s)" if name == "SIGXCPU" else ""
        line = f"killed by {name}{why}"
    else:
        line = f"exit status {status.get('exit')}"
    parts = [line]
    for label, data in (("stdout", outcome.stdout), ("stderr", outcome.stderr)):
        text = _truncate(data.decode("utf-8", "replace"), limits.max_output_chars).rstrip()
        if text:
            parts.append(f"--- {label} ---\n{text}")
    return "\n".join(parts), outcome.killed is None and status.get("exit") == 0


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [truncated {len(text) - limit} more characters]"


app = MCPServer("python_sandbox", instructions="Run Python code in a sandbox.", log_level="WARNING")
_slots: asyncio.Semaphore | None = None


@app.tool()
async def run_python(code: str, timeout_s: float = 5.0) -> str:
    """Run Python 3 code in a fresh sandboxed interpreter and return its output.

    Print what you want to see. No network; files only in the working directory (deleted
    afterwards); limited memory, processes and time. Returns the exit status, stdout and stderr.
    """
    global _slots
    if _slots is None:
        _slots = asyncio.Semaphore(MAX_PARALLEL)
    async with _slots:
        text, ok = await run_code(code, timeout_s)
    if not ok:
        raise ToolError(text)
    return text


def main(argv: list[str] | None = None) -> None:
    global MAX_PARALLEL
    p = _parser("materl python sandbox MCP server")
    p.add_argument("--memory-mb", type=int, default=LIMITS.memory_mb, help="address space per process")
    p.add_argument("--max-timeout", type=float, default=LIMITS.max_timeout_s, help="cap on timeout_s")
    p.add_argument("--max-processes", type=int, default=LIMITS.max_processes, help="processes and threads per run")
    p.add_argument("--max-parallel", type=int, default=MAX_PARALLEL, help="concurrent runs")
    args = p.parse_args(argv)
    LIMITS.memory_mb, LIMITS.max_timeout_s, LIMITS.max_processes = args.memory_mb, args.max_timeout, args.max_processes
    MAX_PARALLEL = args.max_parallel
    _serve(app, args)


if __name__ == "__main__":
    main()
