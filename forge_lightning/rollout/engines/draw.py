"""One token a row from its probabilities, drawn by the inverse of its cumulative distribution.

``torch.multinomial(probs, 1)`` draws one exponential variate per vocabulary entry and keeps the
largest ratio: for 8 rows of SmolLM2's 49,152 tokens that is about 8 ms a decoding step on two
CPU threads, more than a bfloat16 copy's LM head takes, and on every step of every sampler.
:func:`draw` takes one uniform variate a row and finds it in the row's cumulative sums (in
float64): the same distribution (a token with probability 0 is never drawn), from a 49,152th of
the random numbers, in about 0.2 ms.

Both samplers draw so, and so from one seed the same tokens: the servers' decode loop
(serving/decode.py) calls :func:`draw`, and HF ``generate`` (rollout/engines/hf.py) runs inside
:func:`inverse_cdf_sampling`, where ``torch.multinomial`` of one sample a row is :func:`draw`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

_multinomial = torch.multinomial
_lock = threading.Lock()
_depth = 0  # how many inverse_cdf_sampling contexts are open, in any thread


def draw(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """``(..., 1)`` int64: one index a row of ``probs`` ``(..., V)`` (each row non-negative with a
    positive finite sum, not necessarily 1), each with its row's probability, as
    ``torch.multinomial(probs, 1, generator=generator)`` draws them."""
    rows = probs.reshape(-1, probs.shape[-1]).to(torch.float64)  # (N, V)
    cdf = rows.cumsum(dim=-1)
    total = cdf[:, -1:]  # (N, 1)
    if not bool(torch.isfinite(total).all()) or bool((total <= 0).any()) or bool((rows < 0).any()):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    device = probs.device if generator is None else generator.device
    u = torch.rand((rows.shape[0], 1), dtype=torch.float64, device=device, generator=generator)
    picked = torch.searchsorted(cdf, u.to(cdf.device) * total, right=True)  # the first cdf above u
    # u * total rounds to total at worst: then the last token with any probability.
    last = rows.shape[-1] - 1 - (rows > 0).flip(-1).to(torch.uint8).argmax(dim=-1, keepdim=True)
    return torch.minimum(picked, last).reshape(*probs.shape[:-1], 1)


def _one_draw_multinomial(
    input: Tensor,
    num_samples: int,
    replacement: bool = False,
    *,
    generator: torch.Generator | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """``torch.multinomial`` where one sample a row is :func:`draw`'s; any other call as it was."""
    if num_samples == 1 and out is None and input.dim() in (1, 2) and input.is_floating_point():
        return draw(input, generator)
    return _multinomial(input, num_samples, replacement, generator=generator, out=out)


@contextmanager
def inverse_cdf_sampling() -> Iterator[None]:
    """Within it (in every thread: the draw is the same distribution, so a caller elsewhere gets
    what it asked for), ``torch.multinomial(probs, 1)`` draws by :func:`draw`."""
    global _depth
    with _lock:
        _depth += 1
        torch.multinomial = _one_draw_multinomial  # type: ignore[assignment]
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.multinomial = _multinomial  # type: ignore[assignment]
