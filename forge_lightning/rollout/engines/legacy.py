"""Engines written before one ``generate`` took a request: ``generate(model, prompt_ids,
prompt_mask, group_size, params)`` returning the ids, with ``generate_with_logprobs``,
``generate_with_ends`` and ``generate_continuing`` beside it where the engine had them.

:func:`as_engine` is where an engine enters the package (the rollout sampler, the preflight): an
engine that declares its :class:`~forge_lightning.rollout.engines.base.EngineCapabilities` is used
as it is; any other is wrapped in :class:`LegacyEngine`, with a deprecation warning, which reads
the old methods once, here, as its capabilities. This file is the only one that looks for them.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

from transformers import PreTrainedModel

from forge_lightning.rollout.engines.base import (
    Completions,
    EngineCapabilities,
    GenerationBackend,
    GenerationRequest,
)

# The old variants of ``generate`` and the capability each one gave.
_VARIANTS = ("generate_with_logprobs", "generate_with_ends", "generate_continuing")


def as_engine(engine: Any) -> GenerationBackend:
    """``engine`` where it declares its capabilities; else its :class:`LegacyEngine` (warned)."""
    if isinstance(getattr(engine, "capabilities", None), EngineCapabilities):
        return engine
    return LegacyEngine(engine)


class LegacyEngine:
    """An engine of the five-argument ``generate`` behind the one ``generate(model, request)``.

    Its capabilities are those of its old methods: log-probs from ``generate_with_logprobs`` (or
    ``generate_with_ends``/``generate_continuing``), stop strings from ``generate_with_ends``,
    the stop rule from a ``stopping_criteria`` argument of ``generate``, continuing from a cache
    from ``generate_continuing`` (which takes the stop rule too).
    """

    def __init__(self, engine: Any) -> None:
        warnings.warn(
            f"{type(engine).__name__}.generate takes (model, prompt_ids, prompt_mask, group_size, "
            "params): that signature is deprecated; write generate(model, request: GenerationRequest) "
            "-> Completions and declare the engine's capabilities (EngineCapabilities, "
            "forge_lightning.rollout.engines.base)",
            DeprecationWarning,
            stacklevel=3,
        )
        self.engine = engine
        has = {name: callable(getattr(type(engine), name, None)) for name in _VARIANTS}
        self._stops = "stopping_criteria" in inspect.signature(engine.generate).parameters
        self.capabilities = EngineCapabilities(
            logprobs=any(has.values()),
            stop_strings=has["generate_with_ends"],
            stop_rule=self._stops,
            continues=has["generate_continuing"],
        )
        self._has = has

    def generate(self, model: PreTrainedModel, request: GenerationRequest) -> Completions:
        """The old method that gives what ``request`` asks for."""
        self.capabilities.check(request, type(self.engine).__name__)
        r, old = request, self.engine
        args = (model, r.prompt_ids, r.prompt_mask, r.group_size, r.params)
        if r.continuing:
            sequences, cache, logp = old.generate_continuing(*args, list(r.stop_rule), r.cache, r.logprobs)
            return Completions(sequences[:, r.prompt_ids.shape[1] :], logp=logp, cache=cache)
        if r.params.stop or (r.logprobs and not self._has["generate_with_logprobs"]):
            if self._has["generate_with_ends"]:
                return old.generate_with_ends(*args, logprobs=r.logprobs)
            sequences, _, logp = old.generate_continuing(*args, list(r.stop_rule), None, True)
            return Completions(sequences[:, r.prompt_ids.shape[1] :], logp=logp)
        if r.logprobs:
            ids, logp = old.generate_with_logprobs(*args)
            return Completions(ids, logp=logp)
        extra = {"stopping_criteria": list(r.stop_rule)} if self._stops and r.stop_rule else {}
        return Completions(old.generate(*args, **extra))

    def sync_weights(self, model: PreTrainedModel) -> None:
        self.engine.sync_weights(model)
