"""The training side of a GRPO step: log-probs, loss and backward over one rollout."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from forge_lightning.grpo import grpo_loss
from forge_lightning.logprobs import completion_log_probs, supports_shared_prefix
from forge_lightning.rollout import Rollout


@contextmanager
def timed(timings: dict[str, float], phase: str) -> Iterator[None]:
    """Add the wall time of the ``with`` block to ``timings[phase]``.

    On a GPU the queued kernels are waited for at both ends, so the time lands in the phase that
    launched the work rather than in whichever phase happens to synchronize next.
    """
    _synchronize()
    start = time.perf_counter()
    try:
        yield
    finally:
        _synchronize()
        timings[phase] = timings.get(phase, 0.0) + time.perf_counter() - start


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _valid_sequences(part: Tensor, whole: Tensor) -> Tensor:
    return (part.sum(1) > 0).sum() / (whole.sum(1) > 0).sum().clamp(min=1)


def _rows(part: Tensor, whole: Tensor) -> Tensor:
    return torch.tensor(part.shape[0] / whole.shape[0])


def _one(part: Tensor, whole: Tensor) -> Tensor:
    return torch.tensor(1.0)


# The share of the whole rollout's loss that a micro-batch's loss stands for, per loss type, so
# that summing the micro-batches gives the loss (and gradient) of the unsplit batch. dapo needs
# none: it is normalised by the whole rollout's token count directly.
MICRO_BATCH_WEIGHT: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "grpo": _valid_sequences,
    "forge": _rows,
    "dr_grpo": _rows,
    "dapo": _one,
}


@dataclass
class PolicyUpdate:
    """Backpropagates the GRPO loss of a rollout, micro-batch by micro-batch.

    ``backward`` is Lightning's ``manual_backward``; ``hparams`` the module's hyperparameters.
    ``reference_scope`` gives the context the reference forward runs in: ``disable_adapter`` when
    the reference is a LoRA policy's own base weights (``ReferenceModel.scope``).
    ``timings`` collects the seconds spent in each phase: ``logprob`` (every forward: reference,
    old policy, policy, and the loss), ``backward``, and ``optimizer`` (steps taken inside ``run``).
    """

    policy: PreTrainedModel
    reference: PreTrainedModel | None
    hparams: Mapping[str, Any]
    shared_prefix: bool
    backward: Callable[[Tensor], None]
    timings: dict[str, float] = field(default_factory=dict)
    reference_scope: Callable[[], AbstractContextManager[Any]] = nullcontext

    def run(
        self, rollout: Rollout, advantages: Tensor, step_optimizer: Callable[[], None]
    ) -> dict[str, Tensor]:
        """Backward passes for the rollout; with ``num_iterations`` > 1, a step after each pass.

        advantages: (P*G,). Returns the loss and its metrics as detached scalars.
        """
        hp = self.hparams
        with timed(self.timings, "logprob"):
            ref_logp, old_logp = self._fixed_log_probs(rollout)
        stats: dict[str, Tensor] = {}
        for _ in range(hp["num_iterations"]):
            stats = self._backward_rollout(rollout, advantages, old_logp, ref_logp)
            if hp["num_iterations"] > 1:
                with timed(self.timings, "optimizer"):
                    step_optimizer()
        return stats

    def _fixed_log_probs(self, rollout: Rollout) -> tuple[Tensor | None, Tensor | None]:
        """Reference and old-policy log-probs ``(P*G, Lc)``: computed once, before any update."""
        ref_logp = None
        if self.reference is not None:
            with self.reference_scope():
                ref_logp = self.log_probs_no_grad(self.reference, rollout)
        # The sampling engine's own log-probs are the old policy's when it reported them. Otherwise,
        # with one pass the old policy IS the current one: its log-probs are the detached policy
        # log-probs (grpo_loss's default), so the extra forward is skipped.
        old_logp = rollout.old_logp
        if old_logp is None and self.hparams["num_iterations"] > 1:
            old_logp = self.log_probs_no_grad(self.policy, rollout)
        return ref_logp, old_logp

    @property
    def temperature(self) -> float:
        # The Forge loss scores completions at temperature 1; the others at the sampling one.
        return 1.0 if self.hparams["loss_type"] == "forge" else self.hparams["temperature"]

    def log_probs(self, model: PreTrainedModel, rollout: Rollout, start: int, stop: int) -> Tensor:
        """Log-probs ``(stop-start, Lc)`` of completion rows ``[start, stop)`` under ``model``."""
        group = rollout.group_size
        aligned = start % group == 0 and (stop % group == 0 or stop == rollout.completion_ids.shape[0])
        shared = aligned and group > 1 and self.shared_prefix and supports_shared_prefix(model)
        if shared:
            prompt_ids = rollout.prompt_ids[start // group : -(-stop // group)]
            prompt_mask = rollout.prompt_mask[start // group : -(-stop // group)]
        else:
            prompt_ids = rollout.prompt_ids.repeat_interleave(group, dim=0)[start:stop]
            prompt_mask = rollout.prompt_mask.repeat_interleave(group, dim=0)[start:stop]
        return completion_log_probs(
            model,
            prompt_ids,
            prompt_mask,
            rollout.completion_ids[start:stop],
            group_size=group if shared else 1,
            temperature=self.temperature,
            mode="shared_prefix" if shared else "full",
            chunk_size=self.hparams["logprob_chunk_size"],
        )

    @torch.no_grad()
    def log_probs_no_grad(self, model: PreTrainedModel, rollout: Rollout) -> Tensor:
        return torch.cat([self.log_probs(model, rollout, a, b) for a, b in self._micro_batches(rollout)])

    def _micro_batches(self, rollout: Rollout) -> list[tuple[int, int]]:
        rows = rollout.completion_ids.shape[0]
        size = self.hparams["train_micro_batch_size"] or rows
        return [(a, min(a + size, rows)) for a in range(0, rows, size)]

    def _backward_rollout(
        self, rollout: Rollout, advantages: Tensor, old_logp: Tensor | None, ref_logp: Tensor | None
    ) -> dict[str, Tensor]:
        hp = self.hparams
        mask = rollout.completion_mask.float()  # (N, Lc)
        total_tokens = mask.sum().clamp(min=1)
        weight_of = MICRO_BATCH_WEIGHT[hp["loss_type"]]
        totals: dict[str, Tensor] = {}
        for start, stop in self._micro_batches(rollout):
            part = mask[start:stop]
            with timed(self.timings, "logprob"):
                loss, metrics = grpo_loss(
                    self.log_probs(self.policy, rollout, start, stop),
                    None if old_logp is None else old_logp[start:stop],
                    None if ref_logp is None else ref_logp[start:stop],
                    advantages[start:stop],
                    part,
                    loss_type=hp["loss_type"],
                    clip_epsilon=hp["clip_epsilon"],
                    clip_epsilon_high=hp["clip_epsilon_high"],
                    kl_beta=hp["kl_beta"],
                    max_completion_length=hp["max_new_tokens"],
                    token_normalizer=total_tokens,
                )
            weight = weight_of(part, mask).to(loss.device)
            with timed(self.timings, "backward"):
                self.backward(loss * weight / hp["gradient_accumulation_steps"])
            token_share = part.sum() / total_tokens
            parts = {"loss": loss.detach() * weight, "policy_loss": metrics["policy_loss"] * weight}
            parts.update(
                {k: metrics[k] * token_share for k in ("kl", "clip_fraction_low", "clip_fraction_high")}
            )
            for key, value in parts.items():
                totals[key] = totals.get(key, 0) + value.detach()
        totals["clip_fraction"] = totals["clip_fraction_low"] + totals["clip_fraction_high"]
        return totals
