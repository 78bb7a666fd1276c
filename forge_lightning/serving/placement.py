"""Where the rollout servers run: the entries that list them, and starting and stopping what
they ask the trainer to start.

* ``host:port``: a server the user started (``forge-lightning serve``), on any machine; its door
  takes the secret in ``FORGE_LIGHTNING_SERVE_SECRET``, which the trainer must be given too.
* ``local:N``: N ``forge-lightning serve`` child processes of trainer rank 0, on free ports of this
  machine, given a fresh secret in their environment and one CPU thread each (``threads``), on the
  devices the config deals them (``ServeConfig.devices``, round-robin; none: each its own choice);
  their output goes to ``<run folder>/servers/``; they end with the fit, and with the trainer if
  it dies.
* ``ray:N``: N servers placed by Ray (the ``ray`` extra) as actors, each asking for the resources a
  server needs, on the Ray cluster ``RAY_ADDRESS`` names (or a local one); each actor runs the same
  ``forge-lightning serve`` and stops with it.

Every server runs the trainer's model settings (:class:`ServeConfig`). Under DDP rank 0 starts what
is started and tells the other ranks where it is (the trainer's own collective), so every rank
reaches the same servers.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from forge_lightning.serving.devices import server_device
from forge_lightning.serving.processes import (
    ServeConfig,
    free_port,
    spawn_server,
    stop_process,
    wait_until_healthy,
)
from forge_lightning.serving.wire import SECRET_ENV

_ENTRY = re.compile(
    r"^(?:(?P<kind>local|ray):(?P<count>\d+)|(?P<host>\[[0-9a-fA-F:.]+\]|[\w.-]+):(?P<port>\d+))$"
)


@dataclass(frozen=True)
class Entry:
    """One entry of the servers' list: ``count`` servers to start (``local``, ``ray``), or the
    server at ``address`` (``remote``)."""

    kind: Literal["local", "ray", "remote"]
    count: int = 1
    address: str | None = None


def parse_entry(text: str) -> Entry:
    """The :class:`Entry` of ``text``; ValueError saying what an entry looks like."""
    match = _ENTRY.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"rollout server entry {text!r} is not local:N, ray:N or host:port (e.g. local:2, node7:8000)"
        )
    if match["kind"]:
        count = int(match["count"])
        if count < 1:
            raise ValueError(f"rollout server entry {text!r}: {match['kind']}:N starts at least 1 server")
        return Entry(match["kind"], count)  # type: ignore[arg-type]
    if not 0 < int(match["port"]) < 65536:
        raise ValueError(f"rollout server entry {text!r}: the port must be in 1..65535")
    return Entry("remote", 1, f"{match['host']}:{int(match['port'])}")


def valid_entries(value: Any) -> bool:
    """Whether ``value`` is a list of entries :func:`parse_entry` reads (the setting's check)."""
    if not isinstance(value, list | tuple):
        return False
    try:
        [parse_entry(v) for v in value]
    except ValueError:
        return False
    return True


ENTRIES_RULE = (lambda v: v is None or valid_entries(v), "None or a list of 'local:N', 'ray:N', 'host:port'")


def served_model(model: Any, tokenizer: Any, spec: str | None, folder: Path) -> str:
    """The model spec a started server loads: the run's own, or for a model given as an object its
    weights and tokenizer saved under ``folder`` (the servers get every push after anyway)."""
    if spec is not None:
        return spec
    refuse_unloadable_class(model)
    target = folder / "model"
    if not (target / "config.json").is_file():
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
    return str(target)


def refuse_unloadable_class(model: Any) -> None:
    """A model object of a class of its own (a subclass with its own forward, say) would be served
    as the class ``AutoModelForCausalLM`` builds from its config, silently another model: refused,
    naming both, with what to do instead."""
    from transformers import AutoModelForCausalLM, PreTrainedModel  # noqa: PLC0415

    if not isinstance(model, PreTrainedModel):
        return  # a PEFT wrapper: its folder is the adapter's, loaded onto its base (models/loading.py)
    try:
        built = AutoModelForCausalLM._model_mapping[type(model.config)]
    except KeyError:
        built = None
    # The model's own class: FSDP2's fully_shard swaps in a subclass of torch's, which is not one.
    own = next(c for c in type(model).__mro__ if not c.__module__.startswith("torch."))
    if built is not own:
        name = f"{own.__module__}.{own.__qualname__}"
        instead = "no class" if built is None else f"{built.__module__}.{built.__qualname__}"
        raise ValueError(
            f"the rollout servers the trainer starts load the model from a folder with "
            f"AutoModelForCausalLM, which builds {instead} from this model's config, not its class "
            f"{name}: give the model as a spec its servers can load (a saved folder whose class "
            "AutoModelForCausalLM builds, or one registered with AutoModelForCausalLM.register), or "
            "start servers yourself and list them as host:port"
        )


@dataclass
class Placement:
    """The servers of ``entries`` (strings as the setting holds them): :meth:`start` starts those
    the trainer starts and returns every server's ``(name, host:port)``; :meth:`close` ends them."""

    entries: Sequence[str]
    config: ServeConfig
    spec: str | None = None  # the module's model spec; None: the model was given as an object
    # Where started servers' config, logs (and a model given as an object) go: the run folder's
    # servers/ (RemoteSource.connect); None, as in a validate before any fit: a fresh temporary
    # folder at the first start, never the working directory.
    folder: Path | None = None
    secret: str = ""
    processes: list[subprocess.Popen] = field(default_factory=list)
    actors: list[Any] = field(default_factory=list)
    _by_address: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.parsed = [parse_entry(e) for e in self.entries]
        given = os.environ.get(SECRET_ENV)
        if any(e.kind == "remote" for e in self.parsed) and not given:
            raise ValueError(
                f"the rollout servers you started ({', '.join(self.remote)}) need their secret: "
                f"set {SECRET_ENV} to the secret they were started with"
            )
        # Servers the trainer starts share the user's secret where one is given, else a fresh one.
        self.secret = self.secret or given or secrets.token_urlsafe(32)

    def cpu_threads_here(self) -> int:
        """The CPU threads the ``local`` servers take on this machine (those on a GPU, none)."""
        local = sum(e.count for e in self.parsed if e.kind == "local")
        on_cpu = sum(server_device(self.config.device(i)).startswith("cpu") for i in range(local))
        return on_cpu * self.config.threads

    @property
    def remote(self) -> list[str]:
        return [e.address for e in self.parsed if e.kind == "remote"]

    def start(self, model: Any, tokenizer: Any) -> list[tuple[str, str]]:
        """Start the ``local`` and ``ray`` servers (rank 0; the other ranks are told where they
        are) and wait until each answers; every server's ``(name, host:port)``."""
        started: list[tuple[str, str]] = []
        if trainer_rank() == 0 and any(e.kind != "remote" for e in self.parsed):
            if self.folder is None:
                self.folder = Path(tempfile.mkdtemp(prefix="forge-lightning-servers-"))
            model_spec = served_model(model, tokenizer, self.spec, self.folder)
            self.config = replace(self.config, model={**self.config.model, "model": model_spec})
            started = self._start_children()
        started, self.secret = shared_with_ranks((started, self.secret))
        return started + [(address, address) for address in self.remote]

    def _start_children(self) -> list[tuple[str, str]]:
        config = self.config.write(self.folder)
        named = []
        local = sum(e.count for e in self.parsed if e.kind == "local")
        for i in range(local):
            port = free_port()
            log = open(self.folder / f"server-{i + 1}.log", "ab")  # noqa: SIM115 (the child holds it)
            device = self.config.device(i)
            process = spawn_server(config, port, self.secret, self.config.threads, log, device=device)
            self.processes.append(process)
            named.append((f"local:{i + 1} (127.0.0.1:{port}, pid {process.pid})", f"127.0.0.1:{port}"))
            self._by_address[f"127.0.0.1:{port}"] = process
        ray_count = sum(e.count for e in self.parsed if e.kind == "ray")
        if ray_count:
            from forge_lightning.serving.ray_actors import place_servers  # ray: only when asked

            for i, (actor, address) in enumerate(place_servers(ray_count, self.config, self.secret)):
                self.actors.append(actor)
                self._by_address[address] = actor
                named.append((f"ray:{i + 1} ({address})", address))
        for i, (name, address) in enumerate(named[:local]):
            log = self.folder / f"server-{i + 1}.log"
            wait_until_healthy(address, self.secret, self._by_address[address], name, log)
        return named

    def lost(self, address: str) -> None:
        """A server found dead: one of ours is stopped for good (it may only be hung)."""
        process = self._by_address.get(address)
        if isinstance(process, subprocess.Popen):
            stop_process(process)

    def close(self) -> None:
        """Stop every server this placement started; twice is once."""
        for process in self.processes:
            stop_process(process)
        if self.actors:
            from forge_lightning.serving.ray_actors import end_servers

            end_servers(self.actors)
        self.processes, self.actors, self._by_address = [], [], {}


def trainer_rank() -> int:
    """This process's rank among the trainer's (0 outside torch.distributed)."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def shared_with_ranks(value: Any) -> Any:
    """Rank 0's ``value`` on every rank of the trainer's world (the value itself outside one)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
