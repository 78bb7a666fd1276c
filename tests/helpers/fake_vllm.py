"""A fake vLLM for CPU tests: a ``vllm`` module to put in ``sys.modules`` and engines with
``vllm.LLM``'s interface (``generate``, ``apply_model``, ``reset_prefix_cache``) that answer with
scripted completions and record every weight load that reaches their model."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

EOS = 1
TOKEN_LOGP = -0.25  # the log-prob the fake engine reports for every token it samples


class FakeEngineModel:
    """The model inside the engine: keeps a copy of every set of weights loaded into it."""

    def __init__(self) -> None:
        self.loads: list[dict[str, torch.Tensor]] = []

    def load_weights(self, weights: Any) -> set[str]:
        loaded = {name: tensor.detach().clone() for name, tensor in weights}
        self.loads.append(loaded)
        return set(loaded)


class FakeLLM:
    """``vllm.LLM``'s shape. Completion j of a prompt is j+1 copies of the token ``a``, then EOS,
    or ``max_tokens`` copies without EOS when that is longer than the limit."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.model = FakeEngineModel()
        self.requests: list[tuple[list[dict[str, list[int]]], list[Any]]] = []
        self.prefix_cache_resets = 0

    def generate(
        self, prompts: list[dict[str, list[int]]], sampling_params: list[Any], use_tqdm: bool = True
    ):
        self.requests.append((prompts, sampling_params))
        return [
            SimpleNamespace(outputs=[self._completion(params, j) for j in range(params.n)])
            for params in sampling_params
        ]

    def apply_model(self, func: Any) -> list[Any]:
        return [func(self.model)]

    def reset_prefix_cache(self) -> None:
        self.prefix_cache_resets += 1

    def _completion(self, params: Any, j: int) -> SimpleNamespace:
        ids = [self.token] * (j + 1) + [EOS]
        if len(ids) > params.max_tokens:
            ids = [self.token] * params.max_tokens
        return sample(ids, params)


def sample(ids: list[int], params: Any) -> SimpleNamespace:
    """A completion of ``ids`` as vLLM returns it, with ``TOKEN_LOGP`` for each token if asked."""
    logprobs = None
    if params.logprobs is not None:
        # vLLM's shape: per position, a dict from token id to an object with .logprob.
        logprobs = [
            {t: SimpleNamespace(logprob=TOKEN_LOGP), t + 1: SimpleNamespace(logprob=-9.0)} for t in ids
        ]
    return SimpleNamespace(token_ids=ids, logprobs=logprobs)


class CalculatorLLM(FakeLLM):
    """A fake engine whose completions call the inline calculator: a prompt with no answer in it
    gets ``<<2*3=9>> x`` (vLLM does not stop at the call: the tool sampler cuts the row there),
    one that ends with the calculator's answer (``>>``) gets `` ok``; each then EOS."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer.convert_tokens_to_ids("a"))
        self.tok = tokenizer

    def generate(
        self, prompts: list[dict[str, list[int]]], sampling_params: list[Any], use_tqdm: bool = True
    ):
        self.requests.append((prompts, sampling_params))
        written = [self.tok.decode(p["prompt_token_ids"]) for p in prompts]
        return [
            SimpleNamespace(outputs=[self._written(text, params) for _ in range(params.n)])
            for text, params in zip(written, sampling_params)
        ]

    def _written(self, text: str, params: Any) -> SimpleNamespace:
        ids = self.tok.encode(" ok" if text.endswith(">>") else "<<2*3=9>> x", add_special_tokens=False)
        return sample([*ids, EOS][: params.max_tokens], params)


def fake_vllm_module() -> SimpleNamespace:
    """A stand-in for the ``vllm`` module: ``SamplingParams`` keeps its fields, ``LLM`` records the
    arguments of each engine built (``built``) and builds nothing."""
    built: list[dict[str, Any]] = []

    def llm(**kwargs: Any) -> SimpleNamespace:
        built.append(kwargs)
        return SimpleNamespace(kwargs=kwargs)

    return SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw), LLM=llm, built=built)
