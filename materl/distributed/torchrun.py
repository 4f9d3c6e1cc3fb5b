"""Starting learner ranks: process-group set-up, and a ``torchrun`` entry point.

From your own script (run under ``torchrun``, or with ranks you start yourself)::

    from materl.distributed.torchrun import init_from_env
    from materl.distributed.learner import DistributedLearner
    init_from_env()                                   # RANK, WORLD_SIZE, MASTER_ADDR/PORT from torchrun
    learner = DistributedLearner(agents, options, strategy="fsdp2")
    result = learner.step(episodes, ctx)              # every rank, the same batch
    del learner; leave_process_group()                # learners first (see leave_process_group)

Or with batches on disk (written by the driver with ``save_batch``), weights published on disk::

    torchrun --standalone --nproc_per_node=2 -m materl.distributed.torchrun \\
        --batch runs/x/batch-000001.pkl runs/x/batch-000002.pkl --out runs/x/weights --strategy fsdp2

Each batch file is one step: (episodes, StepContext), pickled. The ranks build their agents from
the context's agent specs (float32: a spec carries no dtype), or from ``--agents module:function``
(a function returning the agents by name, the same in every rank), learn on every batch in order, and rank 0 writes ``OUT/v000001/`` (one safetensors
file of trainable weights per agent, and ``metrics.json``) after each step, atomically (a temp
folder renamed into place), so a crash never leaves a partial version. A rank that fails (or
whose peer died: its next collective fails) prints why and exits 1; torchrun then stops the
others and exits non-zero, the versions already published intact. Batch files are pickles: load
only files you wrote.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import ipaddress
import json
import os
import pickle
import shutil
import socket
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from materl.compiler.context import StepContext
from materl.compiler.episode import Episode
from materl.distributed.learner import STRATEGIES, DistributedLearner, RankUpdate
from materl.distributed.state import Weights
from materl.errors import ConfigError

DEFAULT_TIMEOUT_S = 600.0  # a collective waiting this long on a hung rank fails (a dead rank fails at once)


def backend_for(device: str | torch.device) -> str:
    """NCCL for CUDA devices, gloo for the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(rank: int, world_size: int, *, master_addr: str, master_port: int, device: str = "cpu",
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the default process group over TCP (gloo on CPU, NCCL on CUDA: ``device`` is this
    rank's, e.g. ``"cuda:1"``). With ``master_addr`` on loopback (ranks on one machine) every
    socket the group listens on is on loopback (``loopback_store``, ``GLOO_SOCKET_IFNAME`` /
    ``NCCL_SOCKET_IFNAME`` set to the loopback interface unless already set); otherwise the
    rendezvous is PyTorch's (``tcp://``), which listens on every interface so that other
    machines can reach it."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's store: every rank a client
    if not is_loopback(master_addr) or agent_store:
        dist.init_process_group(backend_for(dev), init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                world_size=world_size, timeout=timeout)
        return
    interface = loopback_interface()
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    store = loopback_store(rank, world_size, master_addr, master_port, timeout=timeout)
    dist.init_process_group(backend_for(dev), store=store, rank=rank, world_size=world_size, timeout=timeout)


def is_loopback(addr: str) -> bool:
    """``localhost`` or a loopback IP (127.0.0.0/8, ::1, ::ffff:127.0.0.1)."""
    if addr == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), if found."""
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


def loopback_store(rank: int, world_size: int, host: str, port: int, *, timeout: datetime.timedelta) -> dist.TCPStore:
    """The group's rendezvous for ranks on one machine: rank 0 serves a TCPStore on ``host``
    (loopback) only, through a socket bound here (PyTorch's own TCPStore server binds every
    interface, whatever host it is given: an unauthenticated key-value store that anyone on the
    network could write to); the other ranks connect to it as clients. (torch.distributed's
    ``tcp://`` rendezvous, with ``master_listen_fd``.)"""
    host = "127.0.0.1" if host == "localhost" else host
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(128, world_size))
    except BaseException:
        sock.close()
        raise
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=sock.detach())


def init_from_env(*, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the process group ``torchrun`` describes in the environment; NCCL on
    ``cuda:LOCAL_RANK`` when CUDA is available, else gloo. Returns (rank, world size)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"init_from_env: {', '.join(missing)} not set; start this script with torchrun "
                          f"(torchrun --nproc_per_node=N script.py), or call init_process_group(...)")
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
    init_process_group(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), master_addr=os.environ["MASTER_ADDR"],
                       master_port=int(os.environ["MASTER_PORT"]), device=device, timeout_s=timeout_s)
    return dist.get_rank(), dist.get_world_size()


# ----------------------------------------------------------------------------- agents and batches


AgentFactory = Callable[[], Mapping[str, Any]]


def import_factory(path: str) -> AgentFactory:
    """``"package.module:function"`` -> the function."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ConfigError(f"--agents takes 'module:function', got {path!r}")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ConfigError(f"--agents {path!r}: module {module!r} has no function {name!r}")
    return fn


def build_agents(ctx: StepContext, factory: AgentFactory | None) -> dict[str, Any]:
    """The rank's agents: ``factory()``, else rebuilt from the context's agent specs."""
    if factory is not None:
        return dict(factory())
    return {name: spec.build() for name, spec in ctx.agents.items()}


def save_batch(path: str | os.PathLike, episodes: Sequence[Episode], ctx: StepContext) -> Path:
    """Write one learner step's input for the torchrun entry point (atomically)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        pickle.dump((list(episodes), ctx), f)
    os.replace(tmp, path)
    return path


def load_batch(path: str | os.PathLike) -> tuple[list[Episode], StepContext]:
    with open(path, "rb") as f:
        episodes, ctx = pickle.load(f)  # noqa: S301 - the driver's own batch file (see the module docstring)
    if not isinstance(ctx, StepContext):
        raise ConfigError(f"{str(path)!r} is not a learner batch (episodes, StepContext); got {type(ctx).__name__}")
    return episodes, ctx


def publish_to_disk(out: str | os.PathLike, result: RankUpdate) -> Path:
    """Rank 0: ``OUT/v<version>/<agent>.safetensors`` + ``metrics.json``, renamed into place."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    final = out / f"v{result.version:06d}"
    tmp = out / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, tensors in result.weights.tensors.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / f"{name}.safetensors"))
    (tmp / "metrics.json").write_text(json.dumps(result.metrics, indent=1, sort_keys=True))
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    return final


def load_published(folder: str | os.PathLike, version: int | None = None) -> Weights:
    """The ``Weights`` of a published version (default: the newest) from ``publish_to_disk``'s folder."""
    folder = Path(folder)
    versions = sorted(p for p in folder.glob("v[0-9]*") if p.is_dir())
    if not versions:
        raise ConfigError(f"no published weights in {str(folder)!r} (expected v000001/ ...)")
    chosen = folder / f"v{version:06d}" if version is not None else versions[-1]
    if not chosen.is_dir():
        raise ConfigError(f"no version {version} in {str(folder)!r}; published: {[p.name for p in versions]}")
    tensors = {p.stem: load_file(str(p)) for p in sorted(chosen.glob("*.safetensors"))}
    return Weights(int(chosen.name[1:]), tensors)


# ----------------------------------------------------------------------------- torchrun entry point


def leave_process_group() -> None:
    """Destroy the default process group, after every learner of this process is gone.

    Drop the learners first: a DDP learner's reducer holds a reference to the group, and a group
    destroyed from the reducer's deallocation holds the GIL while it waits for gloo's worker
    threads, one of which may need the GIL to free a finished collective's tensors -- a hang at
    exit (seen under load). Freed from ``destroy_process_group``, torch releases the GIL first."""
    gc.collect()
    dist.destroy_process_group()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m materl.distributed.torchrun",
                                 description="One learner rank; start N of them with torchrun.")
    ap.add_argument("--batch", nargs="+", required=True, help="batch files (save_batch), one per step, in order")
    ap.add_argument("--out", required=True, help="rank 0 publishes OUT/v<version>/ here after each step")
    ap.add_argument("--strategy", choices=STRATEGIES, default="fsdp2")
    ap.add_argument("--agents", help="module:function returning the agents by name (default: the context's specs)")
    ap.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                    help="a collective waiting this long on a hung rank fails")
    return ap.parse_args(argv)


def learn(args: argparse.Namespace, rank: int, world: int) -> None:
    """Every batch in order; rank 0 publishes each version."""
    factory = import_factory(args.agents) if args.agents else None
    learner = None
    for path in args.batch:
        episodes, ctx = load_batch(path)
        if learner is None:
            learner = DistributedLearner(build_agents(ctx, factory), ctx.options, strategy=args.strategy)
        result = learner.step(episodes, ctx)
        if rank == 0:
            where = publish_to_disk(args.out, result)
            print(f"materl learner: version {result.version} from {path} -> {where} "
                  f"(loss {result.metrics['loss']:.6g}, {world} ranks)", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """The torchrun entry point: 0 when every batch was learned; 1 (the traceback printed) when
    this rank failed, e.g. because another rank died (torchrun then stops the other ranks)."""
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    rank, world = init_from_env(timeout_s=args.timeout_s)
    code = 1
    try:
        learn(args, rank, world)
        code = 0
    except Exception:  # printed here, so the traceback (holding the learner) is gone before leaving
        traceback.print_exc()
    finally:
        leave_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
