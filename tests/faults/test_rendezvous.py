"""The learner ranks' sockets, looked at for real (psutil, as ``ss -ltnp`` shows them): ranks on
one machine (master address 127.0.0.1) listen on loopback only, the rendezvous store included
(PyTorch's TCPStore server binds every interface whatever host it is given: before, rank 0
listened on ``*:<master port>``), both for spawned ranks and for Ray actor ranks (in the local
cluster materl starts, whose own services listen on loopback too: ``ray_workers.connect``)."""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path

import psutil
import pytest
import torch.multiprocessing as mp

from materl.compiler.options import CompileOptions
from materl.distributed.torchrun import free_port, is_loopback

from tests.distributed import helpers as H


def listeners(pid: int) -> list[tuple[str, int]]:
    """The (address, port) every listening TCP socket of process ``pid`` is bound to."""
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN]


def on_loopback(ip: str) -> bool:
    """A loopback address, an IPv4-mapped one (``::ffff:127.0.0.1``) included."""
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def rank(r: int, world_size: int, port: int, out: str) -> None:
    """A spawned rank: join the group, list this process's listening sockets, leave."""
    import torch.distributed as dist

    from materl.distributed.torchrun import init_process_group, leave_process_group

    init_process_group(r, world_size, master_addr="127.0.0.1", master_port=port)
    dist.barrier()  # every rank has joined: every socket of the group is open now
    Path(out, f"rank{r}.json").write_text(json.dumps(listeners(os.getpid())))
    dist.barrier()
    leave_process_group()


def test_spawned_local_ranks_listen_on_loopback_only(tmp_path):
    port = free_port()
    mp.spawn(rank, args=(2, port, str(tmp_path)), nprocs=2)
    found = {r: [tuple(x) for x in json.loads((tmp_path / f"rank{r}.json").read_text())] for r in range(2)}
    assert ("127.0.0.1", port) in found[0]  # the rendezvous store, on rank 0, on loopback
    for r, sockets in found.items():
        assert sockets, f"rank {r} lists no listening socket (gloo listens for its peers)"
        assert all(on_loopback(ip) for ip, _ in sockets), (r, sockets)


def test_ray_actor_ranks_on_one_machine_listen_on_loopback_only():
    ray = pytest.importorskip("ray")
    from materl.distributed.ray_group import LearnerGroup

    assert not ray.is_initialized()
    try:  # the group starts materl's local cluster (ray_workers.connect), whose own services are on loopback
        group = LearnerGroup(2, CompileOptions(), agents=H.tiny_agents, strategy="ddp", num_cpus=1)
        try:
            sockets = {pid: listeners(pid) for pid in group.pids}
        finally:
            group.shutdown()
    finally:
        ray.shutdown()
    assert all(sockets.values()), sockets
    for pid, found in sockets.items():
        assert all(on_loopback(ip) for ip, _ in found), (pid, found)


def test_loopback_addresses():
    assert all(map(is_loopback, ("127.0.0.1", "127.0.1.1", "::1", "::ffff:127.0.0.1", "localhost")))
    assert not any(map(is_loopback, ("0.0.0.0", "10.0.0.2", "::", "head-node")))
