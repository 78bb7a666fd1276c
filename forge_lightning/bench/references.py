"""The two references the benchmark measures each timed step against, on the step's own rollout:
plain ``model.generate`` of its batch, and a GRPO step written the obvious way."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from forge_lightning.reporting.profiler import synchronize
from forge_lightning.rollout.types import Rollout


def plain_generate_seconds(
    model: PreTrainedModel, tokenizer: Any, rollout: Rollout, temperature: float
) -> float:
    """``model.generate`` of the rollout's prompts, as many new tokens as the rollout holds."""
    width = rollout.completion_ids.shape[1]
    config = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        max_new_tokens=width,
        min_new_tokens=width,  # the same decoding steps as the timed step took
        num_return_sequences=rollout.group_size,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        use_cache=True,
    )
    model.eval()
    synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=rollout.prompt_ids, attention_mask=rollout.prompt_mask, generation_config=config
        )
    synchronize()
    model.train()
    return time.perf_counter() - start


def straightforward_update_seconds(
    policy: PreTrainedModel, reference: PreTrainedModel | None, rollout: Rollout, args: argparse.Namespace
) -> float:
    """Seconds of a plain GRPO loss forward+backward and reference forward over the rollout."""
    group = rollout.group_size
    input_ids = torch.cat([rollout.prompt_ids.repeat_interleave(group, 0), rollout.completion_ids], 1)
    attention = torch.cat([rollout.prompt_mask.repeat_interleave(group, 0), rollout.completion_mask], 1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    targets, mask = rollout.completion_ids, rollout.completion_mask.float()  # (N, Lc)
    advantages = torch.randn(targets.shape[0], 1, device=targets.device)
    rows = args.train_micro_batch_size or targets.shape[0]

    def log_probs(model: PreTrainedModel, part: slice) -> torch.Tensor:
        logits = model(
            input_ids=input_ids[part],
            attention_mask=attention[part],
            position_ids=positions[part],
            logits_to_keep=targets.shape[1] + 1,
        ).logits[:, :-1]
        logp = torch.log_softmax(logits.float() / args.temperature, dim=-1)
        return logp.gather(-1, targets[part].unsqueeze(-1)).squeeze(-1)  # (n, Lc)

    policy.train()
    synchronize()
    start = time.perf_counter()
    for first in range(0, targets.shape[0], rows):
        part = slice(first, first + rows)
        logp = log_probs(policy, part)
        per_token = -torch.exp(logp - logp.detach()) * advantages[part]
        if reference is not None:
            with torch.no_grad():
                ref_logp = log_probs(reference, part)
            per_token = per_token + args.kl_beta * (torch.exp(ref_logp - logp) - (ref_logp - logp) - 1)
        loss = ((per_token * mask[part]).sum(1) / mask[part].sum(1).clamp(min=1)).mean()
        loss.backward()
    synchronize()
    seconds = time.perf_counter() - start
    policy.zero_grad(set_to_none=True)
    return seconds
