"""Rank 0 rings the other ranks before each announcement, over plain TCP.

MLX's backends wait inside a collective by polling: a rank that sat in a collective while
rank 0 is idle (a server with no request) would keep a core busy. So a following rank
waits for the doorbell in the event loop, at no cost, and enters the collective only once
rank 0 has rung. One byte per announcement on one connection per following rank.

Rank 0 listens on every interface; the others reach it at the address the launcher gave
rank 0 (the ring backend's hostfile, NCCL_HOST_IP), else at this host's name.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path

from smoe.errors import GroupError

CONNECT_SECONDS = 60.0  # how long the ranks wait for one another to connect


def rank0_address() -> str:
    """Where the other ranks reach rank 0, as the launcher knows it."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and Path(hostfile).is_file():
        try:
            first = json.loads(Path(hostfile).read_text())[0]
            return str(first[0] if isinstance(first, list) else first).rsplit(":", 1)[0]
        except (ValueError, IndexError, KeyError, TypeError):
            pass
    return os.environ.get("NCCL_HOST_IP") or socket.gethostbyname(socket.gethostname())


class Bell:
    """Rank 0's side: one connection per following rank."""

    def __init__(self, server: asyncio.Server, followers: int) -> None:
        self._server = server
        self._followers = followers
        self._writers: list[asyncio.StreamWriter] = []
        self._watchers: set[asyncio.Task[None]] = set()
        self._all_in = asyncio.Event()
        # Why the group cannot go on: a rank hung up (its process died). Known at once
        # here, where a collective with the dead rank might wait for the watchdog.
        self.lost: str | None = None

    @classmethod
    async def open(cls, followers: int) -> Bell:
        bell: Bell

        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            bell._writers.append(writer)
            watcher = asyncio.get_running_loop().create_task(bell._watch(reader))
            bell._watchers.add(watcher)
            watcher.add_done_callback(bell._watchers.discard)
            if len(bell._writers) >= bell._followers:
                bell._all_in.set()

        server = await asyncio.start_server(accepted, host="0.0.0.0", port=0)
        bell = cls(server, followers)
        return bell

    @property
    def port(self) -> int:
        return int(self._server.sockets[0].getsockname()[1])

    async def wait_for_followers(self) -> None:
        """GroupError if they have not all connected within CONNECT_SECONDS."""
        try:
            await asyncio.wait_for(self._all_in.wait(), CONNECT_SECONDS)
        except TimeoutError:
            raise GroupError(
                f"{len(self._writers)} of {self._followers} ranks reached rank 0's port "
                f"{self.port} within {CONNECT_SECONDS:g} s; let the ranks reach one another "
                "over TCP (firewall?)"
            ) from None

    async def _watch(self, reader: asyncio.StreamReader) -> None:
        """A follower sends its rank, then nothing: end of file means it is gone."""
        rank = "?"
        try:
            head = await reader.readexactly(4)
            rank = str(int.from_bytes(head, "big"))
            await reader.read()  # until the connection closes
        except (asyncio.IncompleteReadError, OSError):
            pass
        if self.lost is None:
            self.lost = f"rank {rank} hung up (its process ended or lost its network)"

    def check(self) -> None:
        """GroupError if a follower is gone."""
        if self.lost is not None:
            raise GroupError(f"the expert-parallel group broke: {self.lost}; restart every rank")

    async def ring(self) -> None:
        """Ring every follower; GroupError if one is gone."""
        self.check()
        for writer in self._writers:
            writer.write(b"!")
        for writer in self._writers:
            try:
                await writer.drain()
            except OSError as e:
                raise GroupError(f"a rank hung up ({e}); restart every rank") from None

    async def close(self) -> None:
        for watcher in list(self._watchers):
            watcher.cancel()
        for writer in self._writers:
            writer.close()
        self._server.close()


class Door:
    """A following rank's side: waits for rank 0's rings."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def connect(cls, host: str, port: int, rank: int) -> Door:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), CONNECT_SECONDS
            )
        except (OSError, TimeoutError) as e:
            raise GroupError(
                f"cannot reach rank 0 at {host}:{port} ({e}); let the ranks reach one "
                "another over TCP (firewall?)"
            ) from None
        writer.write(rank.to_bytes(4, "big"))  # so that rank 0 can name us if we go
        await writer.drain()
        return cls(reader, writer)

    async def wait(self) -> None:
        """Until rank 0 rings; GroupError if it is gone."""
        try:
            await self._reader.readexactly(1)
        except (asyncio.IncompleteReadError, OSError):
            raise GroupError("rank 0 is gone (its connection closed); restart every rank") from None

    async def close(self) -> None:
        self._writer.close()
