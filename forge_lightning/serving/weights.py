"""Both ends of a weight push from the trainer to a rollout server: a two-member process group of
torch.distributed (gloo), rank 0 the trainer and rank 1 the server, made from a TCPStore the
trainer holds on a port of its own (never the trainer's world: a dead server must not stall the
training collectives), and the disk fallback, a safetensors folder the server reloads.

Tensors go one at a time in the order of the server's parameter list (wire.Info.parameters), each
cast to the server's dtype just before it is sent, so the trainer never holds a second full copy.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from forge_lightning.serving.wire import ParameterSpec

TRAINER_RANK, SERVER_RANK = 0, 1
INDEX_FILE = "index.json"  # the disk fallback's table: which file holds which parameter, in order


def open_store(host: str, port: int, *, master: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store: the trainer holds it (``master``; port 0 picks a free one, read it
    back from ``store.port``), each server connects to it."""
    return dist.TCPStore(
        host, port, is_master=master, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def open_group(
    store_host: str,
    store_port: int,
    prefix: str,
    rank: int,
    timeout_s: float,
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """Join the two-member gloo group under ``prefix`` as ``rank`` (0 the trainer, 1 a server).

    Returns once both members have joined, so the trainer opens its end on a thread while it asks
    the server to open the other (``POST /weights/group``). ``store``: the trainer's own store,
    shared by the groups of all its servers (a prefix each); None connects to ``store_host:store_port``.
    ``timeout_s`` bounds every later send and receive too: a dead peer fails the push, not hangs it.
    """
    if store is None:
        store = open_store(store_host, store_port, master=False, timeout_s=timeout_s)
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2, timedelta(seconds=timeout_s))


def send_parameters(
    group: dist.ProcessGroup, named_tensors: Iterable[tuple[str, Tensor]], specs: list[ParameterSpec]
) -> None:
    """Send each tensor to the server, in the order of its ``specs`` (wire.Info.parameters).

    ``named_tensors`` yields them in that order (the same model class's ``named_parameters()``
    does); each is cast to the server's dtype and moved to the CPU one at a time.
    """
    sent = 0
    for (name, tensor), spec in zip(named_tensors, specs, strict=False):
        _check_matches(name, tensor, spec)
        out = tensor.detach().to(device="cpu", dtype=spec.torch_dtype).contiguous()
        group.send([out], SERVER_RANK, 0).wait()
        sent += 1
    if sent != len(specs):
        raise ValueError(
            f"the trainer sent {sent} parameters but the server holds {len(specs)}: send the same "
            "model's parameters (a LoRA policy sends its merged weights)"
        )


def receive_parameters(group: dist.ProcessGroup, model: nn.Module, names: Iterable[str]) -> int:
    """Receive ``names``' tensors from the trainer, in that order, each copied into the model's
    parameter as it arrives; the number received."""
    params = dict(model.named_parameters())
    count = 0
    with torch.no_grad():
        for name in names:
            param = params[name]
            buffer = torch.empty(param.shape, dtype=param.dtype, device="cpu")
            group.recv([buffer], TRAINER_RANK, 0).wait()
            param.copy_(buffer)
            count += 1
    return count


def _check_matches(name: str, tensor: Tensor, spec: ParameterSpec) -> None:
    if name != spec.name or list(tensor.shape) != spec.shape:
        raise ValueError(
            f"the trainer's parameter {name} {list(tensor.shape)} is not the server's {spec.name} "
            f"{spec.shape}: the server holds another model; start it with the run's own config"
        )


class WeightSender:
    """The trainer's end of one server's push: its group, and the server's parameter list."""

    def __init__(self, group: dist.ProcessGroup, specs: list[ParameterSpec]) -> None:
        self.group = group
        self.specs = specs

    def send(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Every parameter, tensor by tensor (the server is in ``POST /weights/update`` meanwhile)."""
        send_parameters(self.group, named_tensors, self.specs)

    def send_one(self, index: int, name: str, tensor: Tensor) -> None:
        """The ``index``-th parameter alone (a push that sends each gathered tensor to every
        server in turn: serving/pusher.py); :meth:`check_sent` after the last."""
        if index >= len(self.specs):
            raise ValueError(f"the trainer sent more parameters than the server's {len(self.specs)}")
        spec = self.specs[index]
        _check_matches(name, tensor, spec)
        out = tensor.detach().to(device="cpu", dtype=spec.torch_dtype).contiguous()
        self.group.send([out], SERVER_RANK, 0).wait()

    def check_sent(self, count: int) -> None:
        """ValueError where ``count`` parameters are not every one the server holds."""
        if count != len(self.specs):
            raise ValueError(
                f"the trainer sent {count} parameters but the server holds {len(self.specs)}: send "
                "the same model's parameters (a LoRA policy sends its merged weights)"
            )


# --- the disk fallback --------------------------------------------------------------------------


def write_folder(named_tensors: Iterable[tuple[str, Tensor]], path: str | Path) -> Path:
    """Write the weights to the folder ``path``, one safetensors file per parameter so that no
    second full copy is held, with ``index.json`` listing them in order; the folder."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    index: list[list[str]] = []
    for i, (name, tensor) in enumerate(named_tensors):
        file = f"{i:05d}.safetensors"
        save_file({name: tensor.detach().to("cpu").contiguous()}, str(folder / file))
        index.append([name, file])
    # Written last: a reader that finds the index finds every file it names.
    (folder / INDEX_FILE).write_text(json.dumps(index))
    return folder


def _folder_entries(folder: Path) -> Iterator[tuple[str, Path]]:
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        raise FileNotFoundError(
            f"{index_path} not found: the weights folder is written by serving.weights.write_folder"
        )
    for name, file in json.loads(index_path.read_text()):
        yield name, folder / file


def load_folder(model: nn.Module, path: str | Path) -> int:
    """Load a :func:`write_folder` folder into ``model``, tensor by tensor (each cast to the
    parameter's dtype); every parameter must be there. The number loaded."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for name, file in _folder_entries(Path(path)):
            if name not in params:
                raise ValueError(f"{file} holds {name}, which the server's model has no parameter for")
            with safe_open(str(file), framework="pt") as f:
                params[name].copy_(f.get_tensor(name))
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"the weights folder {path} lacks {len(missing)} parameters, e.g. {missing[0]}")
    return len(loaded)
