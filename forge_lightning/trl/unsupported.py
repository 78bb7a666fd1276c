"""TRL's ``GRPOConfig`` fields (and transformers' ``TrainingArguments``) that have no meaning on the
TRL route: each is taken at TRL's default, which changes nothing, and refused by name, with the
reason, at any other value. A name neither TRL nor this route knows is Python's unexpected keyword,
with a "did you mean" where one is close.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

from forge_lightning.settings.trl_names import did_you_mean

_VLLM_SERVER = (
    "vLLM runs in the trainer's process here (use_vllm=True: generation_backend vllm, TRL's colocate "
    "mode); TRL's vLLM server and its options have no counterpart"
)
_ADAPTIVE_ENTROPY = "entropy_coef is a fixed weight here: there is no adaptive entropy control"
_REF_SYNC = "the KL reference stays the initial policy: TR-DPO's reference syncing is not implemented"
_VESPO = "loss_type vespo is not implemented here"
_BATCHING = "generation is HF generate or vLLM here (use_vllm), without transformers' paged batching"
_ADAMW = "AdamW here has torch's betas and epsilon, which are transformers' defaults"

# TRL's name -> (TRL's default, why another value is refused). Each default is TRL 1.16's
# (transformers 5's for TrainingArguments); the value taken changes nothing.
NO_COUNTERPART: dict[str, tuple[Any, str]] = {
    "multi_objective_aggregation": (
        "sum_then_normalize",
        "the weighted rewards are summed before the advantages (TRL's default); normalize_then_sum "
        "(GDPO) is not implemented",
    ),
    "top_entropy_quantile": (1.0, "there is no entropy-quantile token mask here"),
    "use_adaptive_entropy": (False, _ADAPTIVE_ENTROPY),
    "entropy_coef_min": (0.0, _ADAPTIVE_ENTROPY),
    "entropy_coef_max": (1.0, _ADAPTIVE_ENTROPY),
    "entropy_coef_delta": (0.005, _ADAPTIVE_ENTROPY),
    "entropy_target": (0.2, _ADAPTIVE_ENTROPY),
    "off_policy_mask_threshold": (None, "DeepSeek-V3.2's off-policy sequence mask is not implemented"),
    "use_bias_correction_kl": (False, "DeepSeek-V3.2's importance-corrected KL is not implemented"),
    "sync_ref_model": (False, _REF_SYNC),
    "ref_model_mixup_alpha": (0.6, _REF_SYNC),
    "ref_model_sync_steps": (512, _REF_SYNC),
    "vespo_k_pos": (2.0, _VESPO),
    "vespo_lambda_pos": (3.0, _VESPO),
    "vespo_k_neg": (3.0, _VESPO),
    "vespo_lambda_neg": (2.0, _VESPO),
    "router_aux_loss_coef": (0.001, "a mixture-of-experts router's auxiliary loss is not added here"),
    "vllm_mode": ("colocate", _VLLM_SERVER),
    "vllm_model_impl": ("vllm", _VLLM_SERVER),
    "vllm_enable_sleep_mode": (False, _VLLM_SERVER),
    "vllm_structured_outputs_regex": (None, _VLLM_SERVER),
    "vllm_server_base_url": (None, _VLLM_SERVER),
    "vllm_server_host": ("0.0.0.0", _VLLM_SERVER),
    "vllm_server_port": (8000, _VLLM_SERVER),
    "vllm_server_timeout": (240.0, _VLLM_SERVER),
    "vllm_group_port": (51216, _VLLM_SERVER),
    "vllm_max_model_length": (None, _VLLM_SERVER),
    "vllm_tensor_parallel_size": (1, _VLLM_SERVER),
    "vllm_importance_sampling_clip_min": (None, "the rollout correction caps from above only"),
    "ds3_gather_for_generation": (True, "DeepSpeed is not used here (Lightning's DDP and FSDP are)"),
    "use_transformers_continuous_batching": (False, _BATCHING),
    "transformers_continuous_batching_config": (None, _BATCHING),
    "use_transformers_paged": (False, _BATCHING),
    "trust_remote_code": (False, "models load without remote code here"),
    "pad_to_multiple_of": (None, "the sampler pads the batches itself"),
    "disable_dropout": (False, "dropout stays as the model has it"),
    "cast_lm_head_to_fp32": (False, "the LM head is not cast apart from the model"),
    "remove_unused_columns": (False, "every dataset column reaches the rewards (TRL's GRPO default)"),
    "log_multimodal": (True, "there is no multimodal logging here"),
    "log_unique_prompts": (False, "the samples logged are the batch's own"),
    "log_completions_hub_repo": (None, "completions are not uploaded to the Hub"),
    "adam_beta1": (0.9, _ADAMW),
    "adam_beta2": (0.999, _ADAMW),
    "adam_epsilon": (1e-8, _ADAMW),
    "lr_scheduler_kwargs": (None, "the schedules here take no extra arguments"),
    "push_to_hub": (False, "nothing is pushed to the Hub; upload the final/ folder yourself"),
    "hub_model_id": (None, "nothing is pushed to the Hub"),
    "torch_compile": (False, "the policy is not compiled"),
    "use_liger_kernel": (False, "the log-probs are chunked here without Liger's kernels"),
    "deepspeed": (None, "DeepSpeed is not used here (Lightning's DDP and FSDP are)"),
    "fsdp": (None, "FSDP is Lightning's strategy here, not transformers'"),
    "tf32": (None, "set torch.backends.cuda.matmul.allow_tf32 yourself"),
    "dataloader_drop_last": (False, "the last, smaller batch of an epoch is trained on"),
    "logging_first_step": (False, "the log lines come every logging_steps optimizer steps"),
}

# transformers' fields that do nothing in its own Trainer: any value is taken.
NO_EFFECT = ("do_train", "do_eval", "do_predict", "local_rank", "overwrite_output_dir")


def foreign_keywords(kwargs: dict[str, Any], accepted: Iterable[str]) -> dict[str, Any]:
    """``kwargs`` without the names of ``NO_COUNTERPART`` at their defaults and of ``NO_EFFECT``;
    ValueError for such a name at another value, TypeError for a name not taken at all."""
    accepted = list(accepted)
    kept = {}
    for name, value in kwargs.items():
        if name in accepted:
            kept[name] = value
        elif name in NO_COUNTERPART:
            default, why = NO_COUNTERPART[name]
            if value != default:
                raise ValueError(
                    f"GRPOConfig({name}={value!r}) is refused: {why}. TRL's default, {default!r}, is "
                    "the only value taken"
                )
        elif name not in NO_EFFECT:
            said = _unknown(name, accepted)
            raise TypeError(f"GRPOConfig got an unexpected keyword argument {name!r}: {said}")
    return kept


def _unknown(name: str, accepted: list[str]) -> str:
    if name in _training_arguments():
        return (
            f"transformers' TrainingArguments field {name!r} has no meaning on this route: the Lightning "
            "Trainer is built from output_dir, max_steps, num_train_epochs, logging_*, save_*, eval_*, "
            "bf16/fp16, use_cpu and report_to"
        )
    close = did_you_mean(name, [*accepted, *NO_COUNTERPART])
    return f"did you mean {close!r}?" if close else "neither TRL's GRPOConfig nor this route has it"


@functools.cache
def _training_arguments() -> frozenset[str]:
    from transformers import TrainingArguments

    return frozenset(f.name for f in dataclasses.fields(TrainingArguments))
