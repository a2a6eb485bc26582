"""Run by test_jobserver.py inside a recipe of a real GNU make -j3 (with
`+`, so make passes its jobserver on) and no broker reachable: two tokens
in the jobserver, the third slot being the recipe's own."""

from __future__ import annotations

import asyncio

import pytest

from baton_client import AsyncClient, BatonError, Client


def test_with_no_broker_the_jobserver_serves():
    with Client() as client:
        assert client.source == "jobserver"
        with pytest.raises(BatonError, match="status needs the broker"):
            client.status()


def test_tokens_come_from_the_jobserver_and_go_back():
    with Client() as client:
        first, second = client.acquire(), client.acquire(timeout=10)
        assert client.try_acquire() is None
        with pytest.raises(TimeoutError):
            client.acquire(timeout=0.05)
        first.release()
        with client.acquire(timeout=10):
            assert client.try_acquire() is None
        second.release()


def test_acquire_is_all_or_nothing():
    with Client() as client:
        with pytest.raises(TimeoutError):
            client.acquire(3, timeout=0.05)
        both = client.try_acquire(2)  # the two taken before the deadline went back
        assert both is not None
        both.release()


def test_async_tokens_come_from_the_jobserver():
    async def main() -> None:
        async with AsyncClient() as client:
            assert client.source == "jobserver"
            async with client.acquire(2):
                assert await client.try_acquire() is None
                with pytest.raises(TimeoutError):
                    await client.acquire(timeout=0.05)
            token = await client.acquire(2, timeout=10)
            await token.release()

    asyncio.run(main())
