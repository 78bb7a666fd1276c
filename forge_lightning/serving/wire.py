"""The rollout server's wire format: one dataclass per message of its HTTP API, each encoded to and
decoded from plain JSON (``to_json`` / ``from_json``), the door's secret header, and the
fingerprint that tells a trainer whether a server holds its model and tokenizer.

Both ends import this file only, so a message is written once. What arrives is decoded as data and
checked field by field: a malformed message is a :class:`WireError` (one line naming the field),
never an exception from deep inside the server.

Endpoints: ``GET /info`` (:class:`Info`), ``POST /generate`` (:class:`GenerateCall` ->
:class:`GenerateAnswer`), ``POST /weights/group`` (:class:`GroupCall` -> ``{}``), ``POST
/weights/update`` (:class:`UpdateCall` -> :class:`UpdateAnswer`), ``GET /health``
(:class:`Health`); an error is ``{"error": "<one line>"}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import base64
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import torch

from forge_lightning.rollout.engines.base import SamplingParams

# Both ends compute the fingerprint; they find it here with the messages it travels in.
from forge_lightning.serving.fingerprint import (
    differences,
    fingerprint,
    model_fingerprint,
    tokenizer_fingerprint,
)

SECRET_ENV = "FORGE_LIGHTNING_SERVE_SECRET"  # the door's secret, the same on the trainer and the server
MAX_BODY_BYTES = 64 * 1024 * 1024  # aiohttp's client_max_size: a request's prompts, never weights


class WireError(ValueError):
    """A message that does not decode: the field and what was wrong with it."""


def auth_header(secret: str) -> dict[str, str]:
    """The header every request carries through the door."""
    return {"Authorization": f"Bearer {secret}"}


def authorized(header: str | None, secret: str) -> bool:
    """Whether an ``Authorization`` header value carries ``secret`` (compared in constant time)."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].encode(), secret.encode())


def error_body(message: str) -> dict[str, str]:
    """The body of every error answer."""
    return {"error": message}


# --- checked reads of decoded JSON ------------------------------------------------------------


def _get(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], message: str) -> Any:
    if not isinstance(data, Mapping):
        raise WireError(f"{message}: expected a JSON object, got {type(data).__name__}")
    if name not in data:
        raise WireError(f"{message}: missing field {name!r}")
    value = data[name]
    # bool is an int in Python; a JSON true is never a count.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise WireError(f"{message}: field {name!r} must be {_kind_name(kind)}, got a boolean")
    if not isinstance(value, kind):
        raise WireError(f"{message}: field {name!r} must be {_kind_name(kind)}, got {type(value).__name__}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_rows(value: Any, name: str, message: str) -> list[list[int]]:
    if not isinstance(value, list) or not all(isinstance(r, list) and all(map(_is_int, r)) for r in value):
        raise WireError(f"{message}: field {name!r} must be a list of lists of integers")
    return value


def _float_rows(value: Any, name: str, message: str) -> list[list[float]]:
    if not isinstance(value, list) or not all(
        isinstance(row, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in row)
        for row in value
    ):
        raise WireError(f"{message}: field {name!r} must be a list of lists of numbers")
    return [[float(x) for x in row] for row in value]


# --- the generator state ----------------------------------------------------------------------


def encode_rng_state(state: torch.Tensor) -> str:
    """Base64 of a CPU generator's state (``torch.get_rng_state()``, a uint8 tensor)."""
    return base64.b64encode(state.contiguous().numpy().tobytes()).decode("ascii")


def decode_rng_state(text: str) -> torch.Tensor:
    """The uint8 state tensor :func:`encode_rng_state` wrote."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except ValueError as err:
        raise WireError(f"rng_state is not base64: {err}") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


# --- sampling settings ------------------------------------------------------------------------


def encode_params(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams as JSON: ``stop`` as a list, ``extra`` as given (GenerationConfig fields)."""
    out = asdict(params)
    out["stop"] = list(params.stop)
    return out


def decode_params(data: Any) -> SamplingParams:
    """The SamplingParams of :func:`encode_params`; unknown fields are an error, not dropped."""
    if not isinstance(data, Mapping):
        raise WireError("params: expected a JSON object of SamplingParams fields")
    known = {f.name for f in fields(SamplingParams)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise WireError(f"params: unknown SamplingParams fields {unknown}")
    values = dict(data)
    stop = values.get("stop", [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise WireError("params: field 'stop' must be a list of strings")
    values["stop"] = tuple(stop)
    extra = values.get("extra")
    if extra is not None and not isinstance(extra, Mapping):
        raise WireError("params: field 'extra' must be a JSON object or null")
    try:
        return SamplingParams(**values)
    except TypeError as err:
        raise WireError(f"params: {err}") from None


# --- messages ---------------------------------------------------------------------------------


class _Flat:
    """A message whose JSON is its dataclass fields as they are."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]


@dataclass
class GenerateCall:
    """``POST /generate``: sample ``group_size`` completions of each prompt.

    ``rng_state`` (sync mode): sample with a generator set to this state, so the completions equal
    the in-process engine's after ``torch.set_rng_state(state)``; else ``seed`` (async mode): a
    generator of the request's own seeded with it (None: a seed drawn by the server).
    ``min_version``: answer only with weights at least this version. ``partial``: a weight update
    mid-sequence continues the rows with the new weights instead of finishing them with the old.
    """

    request_id: str
    prompts: list[list[int]]  # unpadded prompt token ids, one list per prompt
    group_size: int
    params: SamplingParams
    logprobs: bool = False
    seed: int | None = None
    rng_state: str | None = None  # encode_rng_state of the trainer's CPU generator
    min_version: int = 0
    partial: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompts": self.prompts,
            "group_size": self.group_size,
            "params": encode_params(self.params),
            "logprobs": self.logprobs,
            "seed": self.seed,
            "rng_state": self.rng_state,
            "min_version": self.min_version,
            "partial": self.partial,
        }

    @classmethod
    def from_json(cls, data: Any) -> GenerateCall:
        m = "generate request"
        call = cls(
            request_id=_get(data, "request_id", str, m),
            prompts=_int_rows(_get(data, "prompts", list, m), "prompts", m),
            group_size=_get(data, "group_size", int, m),
            params=decode_params(_get(data, "params", dict, m)),
            logprobs=_get(data, "logprobs", bool, m),
            seed=_get(data, "seed", (int, type(None)), m),
            rng_state=_get(data, "rng_state", (str, type(None)), m),
            min_version=_get(data, "min_version", int, m),
            partial=_get(data, "partial", bool, m),
        )
        if not call.prompts or any(not p for p in call.prompts):
            raise WireError(f"{m}: 'prompts' must hold at least one prompt, none of them empty")
        if call.group_size < 1:
            raise WireError(f"{m}: 'group_size' must be at least 1, got {call.group_size}")
        if call.rng_state is not None:
            decode_rng_state(call.rng_state)  # fails here, not in the decode loop
        return call


@dataclass
class GenerateAnswer(_Flat):
    """The answer to a :class:`GenerateCall`: P*G rows, groups contiguous, unpadded.

    ``completions``: the sampled tokens, through EOS where one came, or cut after the token that
    completed a stop string. ``logp``: the log-prob each token was sampled with (None unless asked).
    ``versions``: per token, the weight version that sampled it. ``truncated``: rows that ended at
    ``max_new_tokens`` without an EOS or a stop string. ``rng_state``: the generator's state after
    sampling, for a call that gave one.
    """

    request_id: str
    completions: list[list[int]]
    logp: list[list[float]] | None
    versions: list[list[int]]
    truncated: list[bool]
    rng_state: str | None = None

    @classmethod
    def from_json(cls, data: Any) -> GenerateAnswer:
        m = "generate answer"
        logp = _get(data, "logp", (list, type(None)), m)
        truncated = _get(data, "truncated", list, m)
        if not all(isinstance(t, bool) for t in truncated):
            raise WireError(f"{m}: field 'truncated' must be a list of booleans")
        answer = cls(
            request_id=_get(data, "request_id", str, m),
            completions=_int_rows(_get(data, "completions", list, m), "completions", m),
            logp=None if logp is None else _float_rows(logp, "logp", m),
            versions=_int_rows(_get(data, "versions", list, m), "versions", m),
            truncated=truncated,
            rng_state=_get(data, "rng_state", (str, type(None)), m),
        )
        lengths = [len(row) for row in answer.completions]
        if [len(row) for row in answer.versions] != lengths or (
            answer.logp is not None and [len(row) for row in answer.logp] != lengths
        ):
            raise WireError(f"{m}: 'logp' and 'versions' must have one entry per completion token")
        if len(answer.truncated) != len(lengths):
            raise WireError(f"{m}: 'truncated' must have one entry per completion")
        return answer


@dataclass
class ParameterSpec:
    """One parameter the server holds, in the order a weight push sends them."""

    name: str
    shape: list[int]
    dtype: str  # torch dtype without "torch.": "float32", "bfloat16"

    def to_json(self) -> list[Any]:
        return [self.name, list(self.shape), self.dtype]

    @classmethod
    def from_json(cls, data: Any) -> ParameterSpec:
        if (
            not isinstance(data, list)
            or len(data) != 3
            or not isinstance(data[0], str)
            or not isinstance(data[1], list)
            or not all(isinstance(n, int) for n in data[1])
            or not isinstance(data[2], str)
        ):
            raise WireError(f"info: a parameter must be [name, [shape...], dtype], got {data!r}")
        return cls(data[0], list(data[1]), data[2])

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_of(self.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WireError(f"unknown dtype {name!r}")
    return dtype


def parameter_specs(named: Iterable[tuple[str, torch.Tensor]]) -> list[ParameterSpec]:
    """The specs of ``model.named_parameters()``: the order both ends of a push walk."""
    return [ParameterSpec(name, list(t.shape), dtype_name(t.dtype)) for name, t in named]


@dataclass
class Info:
    """``GET /info``: what the server holds, for the trainer to check before it connects."""

    fingerprint: dict[str, Any]
    version: int
    parameters: list[ParameterSpec]
    engine: str = "hf"

    def to_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "version": self.version,
            "engine": self.engine,
            "parameters": [p.to_json() for p in self.parameters],
        }

    @classmethod
    def from_json(cls, data: Any) -> Info:
        m = "info"
        return cls(
            fingerprint=_get(data, "fingerprint", dict, m),
            version=_get(data, "version", int, m),
            parameters=[ParameterSpec.from_json(p) for p in _get(data, "parameters", list, m)],
            engine=_get(data, "engine", str, m),
        )


@dataclass
class GroupCall(_Flat):
    """``POST /weights/group``: join the trainer's two-member gloo group (the server is rank 1)
    on the trainer's TCPStore at ``store_host:store_port``, keys under ``prefix``."""

    store_host: str
    store_port: int
    prefix: str
    timeout_s: float = 60.0

    @classmethod
    def from_json(cls, data: Any) -> GroupCall:
        m = "weights group request"
        return cls(
            store_host=_get(data, "store_host", str, m),
            store_port=_get(data, "store_port", int, m),
            prefix=_get(data, "prefix", str, m),
            timeout_s=float(_get(data, "timeout_s", (int, float), m)),
        )


@dataclass
class UpdateCall(_Flat):
    """``POST /weights/update``: load version ``version`` of the weights, from the group (the
    trainer sends them meanwhile) or from the safetensors folder ``path``."""

    version: int
    via: Literal["group", "disk"] = "group"
    path: str | None = None

    @classmethod
    def from_json(cls, data: Any) -> UpdateCall:
        m = "weights update request"
        call = cls(
            version=_get(data, "version", int, m),
            via=_get(data, "via", str, m),
            path=_get(data, "path", (str, type(None)), m),
        )
        if call.via not in ("group", "disk"):
            raise WireError(f"{m}: 'via' must be 'group' or 'disk', got {call.via!r}")
        if call.via == "disk" and not call.path:
            raise WireError(f"{m}: 'via': 'disk' needs the folder in 'path'")
        return call


@dataclass
class UpdateAnswer(_Flat):
    """The answer to an :class:`UpdateCall`: the version the server now holds."""

    version: int

    @classmethod
    def from_json(cls, data: Any) -> UpdateAnswer:
        return cls(version=_get(data, "version", int, "weights update answer"))


@dataclass
class Health(_Flat):
    """``GET /health``: the liveness probe; ``active`` requests decoding, ``queued`` waiting."""

    version: int
    active: int = 0
    queued: int = 0

    @classmethod
    def from_json(cls, data: Any) -> Health:
        m = "health"
        return cls(
            version=_get(data, "version", int, m),
            active=_get(data, "active", int, m),
            queued=_get(data, "queued", int, m),
        )


__all__ = [
    "MAX_BODY_BYTES",
    "SECRET_ENV",
    "GenerateAnswer",
    "GenerateCall",
    "GroupCall",
    "Health",
    "Info",
    "ParameterSpec",
    "UpdateAnswer",
    "UpdateCall",
    "WireError",
    "auth_header",
    "authorized",
    "decode_params",
    "decode_rng_state",
    "differences",
    "dtype_name",
    "dtype_of",
    "encode_params",
    "encode_rng_state",
    "error_body",
    "fingerprint",
    "model_fingerprint",
    "parameter_specs",
    "tokenizer_fingerprint",
]
