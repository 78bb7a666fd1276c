"""``forge-lightning serve --config C [--model.<name> V ...] --port P [--host H]``: a rollout server
(serving/server.py) for the model a run's config names.

The config is the run's own: its ``model:`` section (the module's settings, flat, or under
``init_args``) with the ``--model.<name>`` flags over it names the model and its dtype, loaded as
the module loads its policy (models/loading.py); every other section is read and ignored. The
door's secret comes from ``FORGE_LIGHTNING_SERVE_SECRET``, which the trainer is given too; without
it the server does not start. Once listening it prints one line, ``forge-lightning serve:
listening on http://HOST:PORT``, and serves until SIGTERM or SIGINT.

``--engine vllm`` samples with vLLM (serving/vllm_loop.py) instead of the project's decode loop: it
needs vLLM and a GPU (``pip install "forge-lightning[vllm]"``; pick the GPU with
``CUDA_VISIBLE_DEVICES``), and takes ``vllm_gpu_memory_utilization`` from the config.
"""

from __future__ import annotations

import argparse
import inspect
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import PreTrainedModel

from forge_lightning.models.loading import ModelLoadError, load_model
from forge_lightning.module import GRPOLightningModule
from forge_lightning.serving.decode import DecodeLoop
from forge_lightning.serving.devices import check_rollout_device, server_device
from forge_lightning.serving.server import RolloutServer, secret_from
from forge_lightning.serving.wire import SECRET_ENV

PROG = "forge-lightning serve"
# The module's settings the server reads (load_model's arguments, in order); the others are the trainer's.
USED = ("model", "model_dtype", "attn_implementation")
# ...and those of its engine (--engine vllm).
ENGINE_USED = ("vllm_gpu_memory_utilization", "rollout_precision", "rollout_memory_fraction")
# Seconds a stopping server gives its requests under way, then its decode loop's step, to finish.
STOP_GRACE_S = 5.0


def arguments() -> argparse.ArgumentParser:
    """serve's own options; ``--model.<name> VALUE`` flags are read beside them."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        allow_abbrev=False,
        description=(
            "Serve generation for the model a run's config names, over HTTP behind a secret, for "
            "trainers that list this server as host:port."
        ),
        epilog=(
            f"--model.<name> VALUE sets one of the module's settings over the config's; the server "
            f"reads {', '.join(USED)}. The secret: set {SECRET_ENV} to the value the trainer gets."
        ),
    )
    parser.add_argument(
        "-c", "--config", action="append", default=[], help="a run's config file (repeatable; later ones win)"
    )
    parser.add_argument(
        "--port", type=int, required=True, help="the port to listen on (0: a free one, printed)"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1, this machine only)"
    )
    parser.add_argument(
        "--device",
        default=None,
        help="where the model runs, e.g. cuda:1 (default: cuda where there is one, else cpu)",
    )
    parser.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="what samples: the project's decode loop on HF transformers (hf, default) or vLLM (vllm: "
        "needs vLLM and a GPU; choose the GPU with CUDA_VISIBLE_DEVICES, not --device)",
    )
    return parser


def main(argv: list[str]) -> None:
    """Parse ``argv`` (what follows ``serve``), load the model, serve until stopped."""
    parser = arguments()
    args, rest = parser.parse_known_args(argv)
    try:
        settings = model_settings(args.config, rest)
        secret = secret_from(os.environ)
    except ValueError as err:
        parser.exit(2, f"{PROG}: {err}\n")
    if settings["rollout_memory_fraction"] is not None and args.engine == "hf":
        device = server_device(args.device)
        try:
            check_rollout_device(device, settings["rollout_memory_fraction"])
        except ValueError as err:
            parser.exit(2, f"{PROG}: {err} (--device {device})\n")
    if args.engine == "vllm" and args.device not in (None, "cuda"):
        parser.exit(
            2, f"{PROG}: --engine vllm runs on the GPU vLLM sees: set CUDA_VISIBLE_DEVICES, not --device\n"
        )
    try:
        model, tokenizer = load_model(*(settings[name] for name in USED))
    except ModelLoadError as err:
        parser.exit(2, f"{PROG}: {err}\n")
    server = RolloutServer(model, tokenizer, secret, loop=sampler(args, model, tokenizer, settings))
    url = server.start(args.host, args.port)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop_soon())
    print(f"{PROG}: listening on {url}", flush=True)
    server.wait()
    # A signal's stop: a request under way for a trainer that died is not waited on for long.
    server.stop(grace_s=STOP_GRACE_S)
    # Nothing is left to finish: leave now, not through the interpreter's teardown of torch and
    # Lightning (seconds on a busy machine), so that a server whose trainer died is gone at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def sampler(
    args: argparse.Namespace, model: PreTrainedModel, tokenizer: Any, settings: dict[str, Any]
) -> DecodeLoop:
    """The server's sampler: the decode loop with the model on ``--device``, or vLLM (the model
    stays on the CPU, where pushed weights land before they go into vLLM)."""
    if args.engine == "vllm":
        if settings["rollout_precision"] is not None:
            raise SystemExit(
                f"{PROG}: --engine vllm samples in vLLM's own dtype: leave rollout_precision unset"
            )
        from forge_lightning.serving.vllm_loop import VLLMLoop  # vLLM itself: on the first request

        return VLLMLoop(model, tokenizer, gpu_memory_utilization=settings["vllm_gpu_memory_utilization"])
    device = server_device(args.device)
    share = settings["rollout_memory_fraction"]
    if share is not None:  # a GPU shared with the trainer (main checked it is a CUDA device)
        torch.cuda.set_per_process_memory_fraction(share, torch.device(device))
    return DecodeLoop(model.to(device), tokenizer, precision=settings["rollout_precision"])


def model_settings(configs: list[str], flags: list[str]) -> dict[str, Any]:
    """The settings of :data:`USED` (and whatever else the configs' sections hold): the module's
    defaults, the configs' ``model:`` sections in order, then ``flags`` (``--model.<name> VALUE``
    or ``--model.<name>=VALUE``). ValueError naming a flag that is not one of the module's settings."""
    declared = inspect.signature(GRPOLightningModule.__init__).parameters
    values = {name: declared[name].default for name in (*USED, *ENGINE_USED)}
    for config in configs:
        values.update(_model_section(Path(config)))
    given = _flags(flags)
    values.update({name: value for name, value in given.items() if name in (*USED, *ENGINE_USED)})
    # --model.reward.init_args.url: a setting's own part, for the trainer
    unknown = sorted({name.split(".")[0] for name in given} - set(declared))
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)}: not a setting of the module (see forge-lightning fit --help)"
        )
    if not isinstance(values["model"], str):
        raise ValueError(f"model: the server loads a model spec (a string), got {values['model']!r}")
    return values


def _model_section(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"--config {path}: no such file")
    config = yaml.safe_load(path.read_text()) or {}
    section = (config.get("model") if isinstance(config, dict) else None) or {}
    if isinstance(section, dict) and "init_args" in section:
        section = section["init_args"] or {}
    if not isinstance(section, dict):
        raise ValueError(f"--config {path}: its model section must be a mapping of the module's settings")
    return section


def _flags(flags: list[str]) -> dict[str, Any]:
    """``--model.<name> VALUE`` pairs, each value read as YAML (as the CLI reads it)."""
    values: dict[str, Any] = {}
    i = 0
    while i < len(flags):
        flag = flags[i]
        if not flag.startswith("--model."):
            raise ValueError(
                f"unrecognized argument {flag}: serve takes --config, --port, --host, --device, --model.*"
            )
        name, given, value = flag.removeprefix("--model.").partition("=")
        if not given:
            if i + 1 >= len(flags):
                raise ValueError(f"{flag} needs a value")
            value, i = flags[i + 1], i + 1
        values[name] = yaml.safe_load(value)
        i += 1
    return values


if __name__ == "__main__":
    main(sys.argv[1:])
