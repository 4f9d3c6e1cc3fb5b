"""Requests spread over several httpx pools: built as first used, taken in turn, one SSL context,
all closed by ``aclose`` (the endpoint's shared pools through ``close_pool``)."""

import anyio
import httpx
import pytest

from materl.rollout.http_pools import Pools


def test_clients_are_built_as_first_used_and_taken_in_turn():
    async def main():
        built = []

        def make(**kw):
            built.append(httpx.AsyncClient(**kw))
            return built[-1]

        pools = Pools(make, n=3)
        assert built == []
        order = [pools.next() for _ in range(7)]
        assert order == [built[0], built[1], built[2]] * 2 + [built[0]] and len(built) == 3
        contexts = {id(c._transport._pool._ssl_context) for c in built}
        assert len(contexts) == 1  # one SSL context for all of them
        await pools.aclose()
        assert all(c.is_closed for c in built)
        fresh = pools.next()  # after aclose a new round of clients is built
        assert len(built) == 4 and fresh is built[3] and not fresh.is_closed
        await pools.aclose()

    anyio.run(main)


def test_close_pool_is_used_where_a_client_keeps_its_pool_past_aclose():
    closed = []

    class Shared(httpx.AsyncClient):
        async def aclose(self):  # what an episode's client.close() calls: the pool stays open
            return None

        async def close_pool(self):
            closed.append(self)
            await httpx.AsyncClient.aclose(self)

    async def main():
        pools = Pools(Shared, n=2)
        a, b = pools.next(), pools.next()
        await a.aclose()
        assert not a.is_closed
        await pools.aclose()
        assert closed == [a, b] and a.is_closed and b.is_closed

    anyio.run(main)


def test_at_least_one_pool():
    with pytest.raises(ValueError, match="n >= 1"):
        Pools(httpx.AsyncClient, n=0)
