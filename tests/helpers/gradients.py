"""The parts of the gradient-equivalence runs: seeded settings, another reference model (so the
KL term has a gradient from the first step) and a callback that keeps each step's gradients."""

from __future__ import annotations

import torch

from helpers.models import make_model, make_tokenizer
from helpers.rewards import varied


def other_reference():
    """A ReferenceModel that builds another random tiny model, not a copy of the policy."""
    from forge_lightning.callbacks import ReferenceModel

    class Other(ReferenceModel):
        def _build(self, trainer, policy):
            return make_model(policy.config.vocab_size, seed=5).to(policy.dtype).requires_grad_(False)

    return Other()


def exact_settings(**settings) -> dict:
    """The settings of the gradient-equivalence runs: a seeded tiny policy, fixed completions."""
    torch.manual_seed(1)
    tok = make_tokenizer()
    # float64, so that sums taken in another order agree to far below the tolerances checked
    defaults = dict(model=make_model(len(tok)).double(), tokenizer=tok, reward=varied, max_new_tokens=6)
    defaults.update(kl_beta=0.05, max_grad_norm=None, gradient_accumulation_steps=1, group_size=4)
    return {**defaults, **settings}


def gradient_spy(grads: list):
    """A callback that appends each parameter's gradient to ``grads`` just before the optimizer step."""
    import lightning.pytorch as pl

    class Grads(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads.extend(p.grad.clone() for p in pl_module.model.parameters())

    return Grads()
