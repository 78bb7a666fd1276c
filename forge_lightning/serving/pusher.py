"""Rank 0's weight push to every live rollout server at once, each over a group of its own.

For each server: probe it (a short ``/health``), open its two-member gloo group the first time
(``POST /weights/group`` while this side joins as rank 0), then post ``/weights/update`` while the
tensors go, one by one, over that group (serving/weights.py's sender: both ends walk the
parameters in one order). The servers are pushed concurrently, each in a thread of its own for
the blocking collective, so a dead or slow server never holds another's push; a server whose
probe or push fails is reported back to be marked dead.

Where a server's group cannot be opened (it cannot reach this machine's store: a firewall, another
network), its weights go by disk instead, with a warning: each version is written once to a
safetensors folder (serving/weights.py's ``write_folder``) under ``folder``, which the server must
be able to read (the same machine, or a shared filesystem), and the server loads it
(``POST /weights/update`` with ``via: disk``).

A policy sharded by FSDP is gathered one parameter at a time, a collective every trainer rank
takes part in (serving/served_weights.py): :meth:`WeightPusher.push_gathered` walks the parameters
once and sends each full tensor to every server in turn before the next is gathered, and finishes
the walk whatever fails, so that the other ranks' gathers never wait on it.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import warnings
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from forge_lightning.serving.connection import Connection, EventLoop, Server, ServerDown, ServerError
from forge_lightning.serving.served_weights import served_tensors
from forge_lightning.serving.weights import TRAINER_RANK, WeightSender, open_group, open_store, write_folder
from forge_lightning.serving.wire import GroupCall, UpdateAnswer, UpdateCall

# Seconds a collective with one server may wait on it: a server that stops mid-push costs this
# (its own group's wait, never another's), not torch.distributed's default of 30 minutes.
GROUP_TIMEOUT_S = 60.0


class WeightPusher:
    """The weight groups of this trainer (rank 0) with each server, opened on first use: one
    store here (a free port), a group per server under a prefix of its own."""

    def __init__(
        self,
        http: Connection,
        loop: EventLoop,
        timeout_s: float = GROUP_TIMEOUT_S,
        folder: Path | None = None,
    ) -> None:
        self.http, self.loop, self.timeout_s = http, loop, timeout_s
        self.senders: dict[str, WeightSender] = {}
        self.store: Any = None
        self.opened = 0  # groups opened so far: each gets a prefix of its own
        self.folder = folder or Path.cwd() / "servers"  # where the disk fallback writes each version
        self.by_disk: set[str] = set()  # the servers whose group could not be opened
        self.written: tuple[int, Path] | None = None  # the version on disk, and its folder
        self.writing = asyncio.Lock()  # one writer of a version, however many servers read it

    def push_gathered(
        self, model: PreTrainedModel, version: int, servers: list[Server]
    ) -> list[tuple[Server, str]]:
        """Rank 0's push of a sharded ``model``: one walk of its parameters (each gathered by every
        rank), each full tensor sent to every server over its group; those that failed, with why.
        The walk is finished however the push ends: the other ranks walk it too
        (:func:`walk_in_step`)."""
        tensors = served_tensors(model)
        try:
            return self.loop.run(self._fan_out(tensors, version, servers))
        finally:
            walk_in_step(tensors)

    async def _fan_out(self, tensors: Any, version: int, servers: list[Server]) -> list[tuple[Server, str]]:
        opened = await asyncio.gather(*(self._group_of(s) for s in servers), return_exceptions=True)
        failed: list[tuple[Server, str]] = []
        senders: dict[str, tuple[Server, WeightSender]] = {}
        for server, result in zip(servers, opened):
            if isinstance(result, ServerDown):
                failed.append((server, str(result)))
            elif isinstance(result, BaseException):
                raise result
            else:
                senders[server.address] = (server, result)
        update = UpdateCall(version=version, via="group").to_json()
        answers = {
            address: asyncio.ensure_future(self.http.call(server, "POST", "/weights/update", update))
            for address, (server, _) in senders.items()
        }
        broken = await asyncio.to_thread(fan_out, tensors, {a: sender for a, (_, sender) in senders.items()})
        for address, answer in answers.items():
            server = senders[address][0]
            if address in broken:
                answer.cancel()
                self.senders.pop(address, None)
                failed.append((server, f"weight push: {broken[address]}"))
                continue
            try:
                got = UpdateAnswer.from_json(await answer).version
            except ServerDown as err:
                failed.append((server, str(err)))
                continue
            if got != version:
                raise ServerError(f"rollout server {server.name} holds version {got}, pushed {version}")
        return failed

    async def _group_of(self, server: Server) -> WeightSender:
        """``server``'s sender, its group opened the first time; a sharded policy has no disk fallback
        (its folder would be a second walk of the gathers)."""
        await self.http.health(server)
        if server.address not in self.senders:
            try:
                await self._open(server)
            except RuntimeError as err:
                if isinstance(err, ServerError):
                    raise
                raise ServerError(
                    f"rollout server {server.name}: no weight group ({str(err).splitlines()[0]}); a "
                    "policy sharded by FSDP is pushed over a group only: let the server reach this "
                    "machine's store"
                ) from None
        return self.senders[server.address]

    def push(self, model: PreTrainedModel, version: int, servers: list[Server]) -> list[tuple[Server, str]]:
        """Push ``model``'s weights as ``version`` to ``servers``; those that failed, with why."""
        results = self.loop.run(self._push_all(model, version, servers))
        return [(s, str(r)) for s, r in zip(servers, results) if isinstance(r, ServerDown)]

    async def _push_all(self, model: PreTrainedModel, version: int, servers: list[Server]) -> list[Any]:
        pushes = (self._push(model, version, server) for server in servers)
        results = await asyncio.gather(*pushes, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, ServerDown):
                raise result
        return results

    async def _push(self, model: PreTrainedModel, version: int, server: Server) -> None:
        await self.http.health(server)  # a dead server is found here, before any collective
        if server.address not in self.by_disk and server.address not in self.senders:
            try:
                await self._open(server)
            except RuntimeError as err:  # no group (a ServerError too): its weights go by disk
                self.by_disk.add(server.address)
                warnings.warn(
                    f"rollout server {server.name}: no weight group ({str(err).splitlines()[0]}); its "
                    f"weights go through a folder under {self.folder} instead, which it must be able to read",
                    stacklevel=2,
                )
        if server.address in self.by_disk:
            await self._push_by_disk(model, version, server)
            return
        try:
            sender = self.senders[server.address]
            update = UpdateCall(version=version, via="group")
            answer = asyncio.ensure_future(
                self.http.call(server, "POST", "/weights/update", update.to_json())
            )
            try:
                await asyncio.to_thread(sender.send, served_tensors(model))
            except BaseException:
                answer.cancel()
                raise
            got = UpdateAnswer.from_json(await answer).version
        except RuntimeError as err:  # the collective broke: the server went away mid-push
            if isinstance(err, ServerError):
                raise
            self.senders.pop(server.address, None)
            raise ServerDown(f"weight push: {err}".splitlines()[0]) from None
        if got != version:
            raise ServerError(f"rollout server {server.name} holds version {got} after a push of {version}")

    async def _open(self, server: Server) -> WeightSender:
        """This side of ``server``'s group (rank 0), opened while the server joins as rank 1."""
        host = reachable_address(server.address)
        if self.store is None:
            self.store = open_store(host, 0, master=True, timeout_s=self.timeout_s)
        self.opened += 1
        call = GroupCall(host, self.store.port, f"server{self.opened}/", self.timeout_s)
        specs = (await self.http.info(server)).parameters
        joined = asyncio.ensure_future(self.http.call(server, "POST", "/weights/group", call.to_json()))
        try:
            group = await asyncio.to_thread(
                open_group, host, self.store.port, call.prefix, TRAINER_RANK, self.timeout_s, self.store
            )
        except BaseException:
            joined.cancel()
            raise
        await joined
        self.senders[server.address] = sender = WeightSender(group, specs)
        return sender

    async def _push_by_disk(self, model: PreTrainedModel, version: int, server: Server) -> None:
        """``version`` written once to a folder (the first server to need it writes it), then
        loaded by ``server``."""
        async with self.writing:
            if self.written is None or self.written[0] != version:
                folder = self.folder / "weights" / f"v{version}"
                await asyncio.to_thread(write_folder, served_tensors(model), folder)
                if self.written is not None:
                    shutil.rmtree(self.written[1], ignore_errors=True)  # the servers load the newer one
                self.written = (version, folder)
        update = UpdateCall(version=version, via="disk", path=str(self.written[1].resolve()))
        answer = await self.http.call(server, "POST", "/weights/update", update.to_json())
        got = UpdateAnswer.from_json(answer).version
        if got != version:
            raise ServerError(f"rollout server {server.name} holds version {got} after a push of {version}")

    def close(self) -> None:
        self.senders, self.store = {}, None


def fan_out(tensors: Any, senders: dict[str, WeightSender]) -> dict[str, str]:
    """Send each of ``tensors`` to every sender in turn, the ones that broke left out from then on;
    the broken ones (by address) with why."""
    broken: dict[str, str] = {}
    count = 0
    for count, (name, tensor) in enumerate(tensors, start=1):
        for address, sender in senders.items():
            if address not in broken:
                try:
                    sender.send_one(count - 1, name, tensor)
                except RuntimeError as err:  # the collective broke: the server went away
                    broken[address] = str(err).splitlines()[0]
    for address, sender in senders.items():
        if address not in broken:
            sender.check_sent(count)
    return broken


def walk_in_step(tensors: Any) -> None:
    """Exhaust a sharded policy's :func:`served_tensors` (every rank's part in each gather)."""
    for _ in tensors:
        pass


def reachable_address(server_address: str) -> str:
    """This machine's address as ``server_address`` (host:port) reaches it: the loopback for a
    server here, else the address of the interface the route to it leaves by (no packet is sent)."""
    host = server_address.rpartition(":")[0].strip("[]")
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]
