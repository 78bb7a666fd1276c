"""``ray:N`` servers: N rollout servers placed by Ray, each an actor holding one
``forge-lightning serve`` process on the node Ray chose, with the CPUs and, where
the servers' devices are CUDA, the GPU a server needs. Ray is the optional ``ray`` extra
(``pip install "forge-lightning[ray]"``); the cluster is ``RAY_ADDRESS``'s, or a local one.

The model spec must be loadable on every node (a hub id, or a path on a shared file system).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from forge_lightning.serving.processes import (
    ServeConfig,
    free_port,
    spawn_server,
    stop_process,
    wait_until_healthy,
)


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError(
            "ray:N rollout servers need Ray: pip install 'forge-lightning[ray]' (or pip install ray)"
        ) from None
    return ray


class ServerActor:
    """One server on a Ray node: :meth:`start` runs ``forge-lightning serve`` there on a free port
    and returns its ``host:port`` once it answers; :meth:`close` ends it."""

    def __init__(self, config: dict[str, Any], threads: int, secret: str, device: str | None = None) -> None:
        self.config, self.threads, self.secret, self.device = config, threads, secret, device
        self.process: Any = None

    def start(self) -> str:
        folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"forge-serve-{os.getpid()}"
        path = ServeConfig(self.config, self.threads).write(folder)
        host = _ray().util.get_node_ip_address()
        port = free_port()
        log = open(folder / "server.log", "ab")  # noqa: SIM115 (the server process holds it)
        # Listening on the node's own address, the one the trainer reaches it at (through the door).
        self.process = spawn_server(path, port, self.secret, self.threads, log, host=host, device=self.device)
        address = f"{host}:{port}"
        wait_until_healthy(address, self.secret, self.process, f"ray actor {address}", folder / "server.log")
        return address

    def close(self) -> None:
        if self.process is not None:
            stop_process(self.process)


def place_servers(count: int, config: ServeConfig, secret: str) -> list[tuple[Any, str]]:
    """Start ``count`` server actors (``config.threads`` CPUs each, and one GPU each where the
    servers' devices are CUDA: :func:`ray_device`) and wait for them; each actor with its
    ``host:port``."""
    device = ray_device(config)
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True, log_to_driver=False)
    actor_class = ray.remote(num_cpus=config.threads, num_gpus=1 if device == "cuda" else 0)(ServerActor)
    actors = [actor_class.remote(config.model, config.threads, secret, device) for _ in range(count)]
    addresses = ray.get([actor.start.remote() for actor in actors])
    return list(zip(actors, addresses))


def ray_device(config: ServeConfig) -> str | None:
    """Where each Ray server samples: ``cuda`` (the GPU Ray gives its actor, which Ray makes the
    only one the actor sees) when the servers' devices name CUDA, ``cpu`` when they name
    the CPU, else the server's own choice. Which GPU is Ray's to say, not an index's."""
    if any(d.startswith("cuda") for d in config.devices):
        return "cuda"
    return "cpu" if config.devices else None


def end_servers(actors: list[Any]) -> None:
    """Stop each actor's server, then the actor."""
    ray = _ray()
    try:
        ray.get([actor.close.remote() for actor in actors], timeout=30)
    finally:
        for actor in actors:
            ray.kill(actor)
