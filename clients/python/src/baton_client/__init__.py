"""Client for the baton token broker: take a job slot, give it back.

    from baton_client import Client

    client = Client(label="my-tool")
    with client.acquire():        # waits for a token
        run_one_job()             # the token goes back at the end

Tokens belong to the connection: if the process dies, even by kill -9, the
broker takes them back at once. With no broker reachable but a GNU make
jobserver in MAKEFLAGS, the same calls take tokens from that jobserver.
The protocol is docs/protocol.md of the baton project.

FastClient binds libbaton (clients/c) for the shared-memory fast path
(docs/fastpath.md): single tokens passed between a build's processes
without a round trip to the broker.
"""

from ._async import AsyncClient, AsyncToken
from ._client import Client, Token
from ._fast import FastClient, NoLibraryError
from ._wire import BatonError, DisconnectedError, NoBrokerError, NotOurBrokerError, RefusedError, socket_path

__all__ = [
    "AsyncClient",
    "AsyncToken",
    "BatonError",
    "Client",
    "DisconnectedError",
    "FastClient",
    "NoBrokerError",
    "NoLibraryError",
    "NotOurBrokerError",
    "RefusedError",
    "Token",
    "socket_path",
]
