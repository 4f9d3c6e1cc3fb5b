"""How to reach one MCP server, and what the Toolbox may do with it: ``MCPServer``.

This module only describes servers (no process is started, nothing is imported from the
connection modules): ``materl.rollout.mcp`` (the Toolbox) and the connection modules
``_mcp_connection`` / ``_mcp_server`` all import it, and not each other's settings.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from materl.errors import ConfigError
from materl.rollout._mcp_connection import RECONNECT_S, START_TIMEOUT_S

if TYPE_CHECKING:
    from materl.rollout._mcp_server import _MCPBackend
    from materl.rollout.tool_backend import ToolSettings

__all__ = ["EPISODE_DIR", "ISOLATIONS", "MCPServer", "RETRY_ON_CRASH", "START_TIMEOUT_S", "URL_SCHEMES", "looks_like_url"]

# MCPServer(retry_on_crash=): retry a call its server died under? "idempotent": when its tool
# declares itself read-only or idempotent (MCP annotations readOnlyHint / idempotentHint)
RETRY_ON_CRASH = (True, False, "idempotent")
ISOLATIONS = ("shared", "episode")
URL_SCHEMES = ("http", "https")  # streamable HTTP; the mcp SDK (2.x) has no WebSocket client
# Replaced, in an isolated (isolation="episode") stdio server's command, env values and cwd, by
# that instance's own working directory.
# Instances kept started and unused: a shared server's ready replacement (a crash costs no
# start-up wait), or the next episodes' own instances.
DEFAULT_POOL = {"shared": 1, "episode": 4}
EPISODE_DIR = "{episode_dir}"
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def looks_like_url(text: str) -> bool:
    """``scheme://...``: a URL, whatever its scheme (never a command line)."""
    return bool(_URL.match(text.strip()))


@dataclass(frozen=True, kw_only=True)
class MCPServer:
    """One MCP server: ``command`` (stdio; a string is split like a shell would) or ``url``
    (streamable HTTP). Fields left ``None`` take the ``mcp_tools`` defaults: ``timeout_s``,
    ``max_concurrency`` (per instance), ``isolation`` ("shared" or "episode"), ``pool_size``
    (pre-started instances), ``retry_on_crash`` (``RETRY_ON_CRASH``), ``restart_after_timeouts``. ``start_timeout_s``
    bounds one start (connect and list tools). ``reconnect_s`` (HTTP only) bounds how long one
    call waits for a server that went away to answer again; the Toolbox keeps reconnecting
    for as long as the run lasts.
    ``prefix`` names its tools ``prefix.tool``. A leading ``python``/``python3`` in ``command``
    runs as ``sys.executable``. A stdio server gets the SDK's safe default environment (PATH,
    HOME, ...), this process's ``PYTHONDONTWRITEBYTECODE`` and, when it runs as
    ``sys.executable``, its ``PYTHONPATH`` (``INHERITED_ENV``: so a materl found through
    ``PYTHONPATH`` can start its own servers), plus ``env``, which wins. With ``isolation="episode"``, ``{episode_dir}`` in ``command``,
    ``env`` values and ``cwd`` is the instance's own working directory (also its cwd when
    ``cwd`` is not given), removed when its episode ends. (Not the SDK's server class
    ``mcp.server.mcpserver.MCPServer``: this one only describes how to reach a server.)"""

    command: str | Sequence[str] | None = None
    url: str | None = None
    name: str = ""
    prefix: str | None = None
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    max_concurrency: int | None = None
    timeout_s: float | None = None
    isolation: str | None = None
    pool_size: int | None = None
    retry_on_crash: bool | str | None = None
    restart_after_timeouts: int | None = None
    start_timeout_s: float = START_TIMEOUT_S
    reconnect_s: float = RECONNECT_S

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise ConfigError(f"MCPServer needs exactly one of command= or url=, got command={self.command!r}, "
                              f"url={self.url!r}")
        if self.command is not None and not self.argv:
            raise ConfigError(f"MCPServer command is empty: {self.command!r}")
        if self.url is not None:
            scheme = urlsplit(self.url).scheme
            if scheme not in URL_SCHEMES:
                raise ConfigError(f"MCPServer url {self.url!r}: the {scheme or '(none)'}:// transport is not "
                                  f"supported; accepted: http:// or https:// (streamable HTTP), or a command line "
                                  f"(stdio)")
            if EPISODE_DIR in self.url:
                raise ConfigError(f"MCPServer url {self.url!r}: {EPISODE_DIR} is for stdio servers (their "
                                  f"command, env and cwd); an HTTP server keeps its own state")
        check_settings(self.timeout_s, self.max_concurrency, self.isolation, self.pool_size,
                       self.restart_after_timeouts, where=f"MCPServer {self.label!r}", retry_on_crash=self.retry_on_crash)
        for key in ("start_timeout_s", "reconnect_s"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ConfigError(f"MCPServer {self.label!r}: {key} must be > 0, got {value!r}")

    @property
    def argv(self) -> list[str]:
        if self.command is None:
            return []
        argv = shlex.split(self.command) if isinstance(self.command, str) else [str(a) for a in self.command]
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        return argv

    @property
    def uses_episode_dir(self) -> bool:
        """Whether ``{episode_dir}`` appears in the command, an env value or the cwd."""
        texts = [*self.argv, *(self.env or {}).values(), self.cwd or ""]
        return any(EPISODE_DIR in str(t) for t in texts)

    def launch(self, episode_dir: str | None) -> tuple[list[str], dict[str, str], str | None]:
        """(argv, env, cwd) for one stdio instance, ``{episode_dir}`` replaced by ``episode_dir``
        (which is also the cwd when ``cwd`` is not set). A relative program path
        (``bin/server``) is made absolute first, as the program then starts in another folder;
        other relative paths in the arguments resolve in the new cwd."""
        argv = self.argv
        env = {**inherited_env(argv), **{str(k): str(v) for k, v in (self.env or {}).items()}}
        if episode_dir is None:
            return argv, env, self.cwd

        def fill(text: str) -> str:
            return text.replace(EPISODE_DIR, episode_dir)

        if os.sep in argv[0] and not os.path.isabs(argv[0]) and EPISODE_DIR not in argv[0]:
            argv = [os.path.abspath(argv[0]), *argv[1:]]
        return ([fill(a) for a in argv], {k: fill(v) for k, v in env.items()},
                fill(self.cwd) if self.cwd is not None else episode_dir)

    @property
    def label(self) -> str:
        """``name``, else derived: ``-m pkg.mod`` -> ``mod``, ``path/x.py`` -> ``x``, URL -> host:port."""
        if self.name:
            return self.name
        if self.url is not None:
            return urlsplit(self.url).netloc or self.url
        argv = self.argv
        if "-m" in argv[:-1]:
            return argv[argv.index("-m") + 1].rsplit(".", 1)[-1]
        script = next((a for a in argv if a.endswith(".py")), argv[0] if argv else "server")
        return os.path.splitext(os.path.basename(script))[0]

    def describe(self) -> str:
        return self.url if self.url is not None else shlex.join(self.argv)

    def backend(self, name: str, settings: ToolSettings) -> _MCPBackend:
        """The server's supervised instances (``tool_backend.ToolSource``), with this spec's fields
        over the Toolbox's ``settings``."""
        from materl.rollout._mcp_server import ServerPolicy, _MCPBackend

        isolation = self.isolation or settings.isolation
        if isolation != "episode" and self.uses_episode_dir:
            raise ConfigError(f"tool server {name!r} ({self.describe()}) uses {EPISODE_DIR}, which exists only "
                              f"for isolation='episode' (one instance per episode); it has isolation={isolation!r}")
        pool = _pick(self.pool_size, _pick(settings.pool_size, DEFAULT_POOL[isolation]))
        policy = ServerPolicy(
            timeout_s=self.timeout_s or settings.timeout_s, max_concurrency=self.max_concurrency or settings.max_concurrency,
            restart=settings.restart, retry_on_crash=_pick(self.retry_on_crash, settings.retry_on_crash),
            restart_after_timeouts=_pick(self.restart_after_timeouts, settings.restart_after_timeouts),
            isolation=isolation, pool_size=pool if settings.restart or isolation == "episode" else 0,
            start_timeout_s=self.start_timeout_s, reconnect_s=self.reconnect_s, workdir=settings.workdir)
        return _MCPBackend(self, name, policy)


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


# Variables a stdio server takes from this process beyond the MCP SDK's default environment:
# name -> whether only servers that run as this interpreter (``sys.executable``) get it.
INHERITED_ENV = {"PYTHONDONTWRITEBYTECODE": False, "PYTHONPATH": True}


def inherited_env(argv: Sequence[str]) -> dict[str, str]:
    """The ``INHERITED_ENV`` variables this process has that a server run as ``argv`` gets.
    ``PYTHONPATH`` goes only to this interpreter: another Python (a tool's own virtualenv) would
    import this one's packages over its own."""
    same_python = bool(argv) and argv[0] == sys.executable
    return {k: os.environ[k] for k, python_only in INHERITED_ENV.items()
            if k in os.environ and (same_python or not python_only)}


def check_settings(timeout_s: Any, max_concurrency: Any, isolation: Any, pool_size: Any,
                   restart_after_timeouts: Any, *, where: str, retry_on_crash: Any = None) -> None:
    """ConfigError naming ``where`` for a setting out of range (``None``: not set)."""
    if retry_on_crash is not None and not any(retry_on_crash is v or retry_on_crash == v and isinstance(v, str)
                                              for v in RETRY_ON_CRASH):
        raise ConfigError(f"{where}: retry_on_crash={retry_on_crash!r}; accepted: True (retry every call its server "
                          f"died under), 'idempotent' (only tools that declare readOnlyHint or idempotentHint), False")
    if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ConfigError(f"{where}: timeout_s must be > 0, got {timeout_s!r}")
    if max_concurrency is not None and not (isinstance(max_concurrency, int) and max_concurrency >= 1):
        raise ConfigError(f"{where}: max_concurrency must be an integer >= 1, got {max_concurrency!r}")
    if isolation is not None and isolation not in ISOLATIONS:
        raise ConfigError(f"{where}: isolation={isolation!r}; accepted: {', '.join(ISOLATIONS)}")
    if pool_size is not None and not (isinstance(pool_size, int) and pool_size >= 0):
        raise ConfigError(f"{where}: pool_size must be an integer >= 0, got {pool_size!r}")
    if restart_after_timeouts is not None and not (isinstance(restart_after_timeouts, int)
                                                   and restart_after_timeouts >= 0):
        raise ConfigError(f"{where}: restart_after_timeouts must be an integer >= 0 (0: never), "
                          f"got {restart_after_timeouts!r}")
