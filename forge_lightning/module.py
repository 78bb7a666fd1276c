"""GRPOLightningModule: group rollouts, rewards and the clipped policy-gradient step in Lightning."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from typing_extensions import override

from forge_lightning.callbacks.reference import ReferenceModel
from forge_lightning.checkpoint_io import rng_states, set_rng_states
from forge_lightning.config import validate_hparams
from forge_lightning.data.datamodule import split_batch
from forge_lightning.grpo import group_advantages
from forge_lightning.hf_compat import is_checkpointing, set_checkpointing
from forge_lightning.logprobs import supports_shared_prefix
from forge_lightning.lora import LoraSettings, apply_lora, lora_settings
from forge_lightning.metrics import TrainMetrics, step_metrics
from forge_lightning.models import ensure_pad_token, load_model
from forge_lightning.optim import (
    NonFiniteGuard,
    adamw_with_schedule,
    can_fuse_adamw,
    gradient_norm,
    total_optimizer_steps,
)
from forge_lightning.policy_update import PolicyUpdate, timed
from forge_lightning.rewards import GSM8KAnswerReward, component_names, score
from forge_lightning.rollout import (
    GenerationBackend,
    HFGenerate,
    LogProbGenerationBackend,
    Rollout,
    SamplingParams,
    completion_mask,
    decode_completions,
    encode_prompts,
    eos_token_ids,
)
from forge_lightning.sharding import is_sharded, shard_policy
from forge_lightning.vllm_backend import VLLMGenerate


class GRPOLightningModule(pl.LightningModule):
    """GRPO fine-tuning of a HuggingFace causal LM.

    Each ``training_step`` takes a batch of prompts, samples ``group_size`` completions per prompt,
    scores them, turns the scores into group-relative advantages and backpropagates the clipped
    surrogate loss with a KL pull toward the frozen reference. Optimization is manual: an
    optimizer step every ``gradient_accumulation_steps`` batches (and at the end of an epoch), so
    ``trainer.global_step`` counts optimizer steps.

    Args:
        model: a model spec (``embedded``, a hub id, a local folder, a ``.gguf`` file,
            ``random:<spec>``; see :mod:`forge_lightning.models`) loaded in ``configure_model``,
            or an already-built HF causal LM (then ``tokenizer`` is required).
        reward: a reward object or any callable ``(prompts, responses, **kwargs) -> list[float]``;
            defaults to :class:`~forge_lightning.rewards.GSM8KAnswerReward`.
        tokenizer: the tokenizer when ``model`` is an object; loaded with the spec otherwise.
        group_size: completions sampled per prompt (G), at least 2.
        clip_epsilon: PPO clip range below 1 (and above, unless ``clip_epsilon_high`` is set).
        clip_epsilon_high: upper clip range (DAPO's clip-higher); None means ``clip_epsilon``.
        kl_beta: weight of the KL penalty toward the reference; 0 drops the reference entirely.
        temperature: sampling temperature; the log-probs of grpo/dapo/dr_grpo use the same one.
        top_p: nucleus sampling mass (1.0 samples from the whole distribution).
        top_k: sample among the k most likely tokens (0 disables).
        max_new_tokens: longest completion, in tokens.
        learning_rate: AdamW learning rate (peak of the cosine schedule).
        weight_decay: AdamW weight decay.
        gradient_accumulation_steps: batches per optimizer step.
        max_grad_norm: clip the total gradient norm to this before each step; None disables.
        warmup_steps: optimizer steps of linear warmup before the schedule.
        lr_schedule: ``cosine`` decays to zero at the last optimizer step (Forge's schedule);
            ``constant`` keeps the peak rate after the warmup, which a run of a few dozen steps
            may want: under the cosine its last third trains at a quarter of the rate or less.
        loss_type: ``grpo`` (per-sequence token mean), ``dapo`` (token mean over the rollout),
            ``dr_grpo`` (constant normaliser) or ``forge`` (the Forge reference's sequence-level
            loss against the reference; reproduces its numbers).
        advantage_scale: divide group-centred rewards by the group std (``group``), the batch
            std (``batch``) or nothing (``none``).
        num_iterations: optimizer passes over each rollout (mu); >1 needs accumulation 1.
        train_micro_batch_size: completions per training forward/backward; None does the whole
            rollout at once. Bounds memory without changing the loss or its gradient.
        max_prompt_length: prompts longer than this many tokens are cut from the left.
        prompt_truncation: ``left`` truncates with a warning, ``error`` refuses long prompts.
        use_chat_template: put prompts through the tokenizer's chat template; None turns it on
            when the tokenizer has one.
        system_prompt: system message for the chat template.
        on_reward_error: ``raise`` names the reward and sample that failed; ``zero`` scores that
            sample 0, warns and counts it.
        max_consecutive_bad_steps: non-finite gradients skip the optimizer step; this many in a
            row stop training with an error.
        prefix_sharing: run each prompt's forward once per group and share its keys/values with
            the G completions (falls back to the full forward where the model has no cache).
        logprob_chunk_size: rows per chunk of the float32 log-softmax work; None for no chunks.
        gradient_checkpointing: trade compute for activation memory in the training forward.
        generation_backend: ``hf`` samples with the policy's own ``generate`` (any device, the
            default); ``vllm`` with a vLLM engine on the same GPU that receives the weights after
            every optimizer step (GPU only: ``pip install "forge-lightning[vllm]"``).
        vllm_gpu_memory_utilization: share of the GPU's memory the vLLM engine may take for its
            weights and KV cache; training has the rest.
        use_engine_logprobs: take the old-policy log-probs of the loss from the engine that
            sampled (vLLM only; needs ``top_p`` 1 and ``top_k`` 0, so that both sides score the
            same temperature-scaled distribution). The ratio then also corrects for the engine's
            numerical drift from the training forward.
        peft: train a LoRA adapter (PEFT) instead of every weight; None is full fine-tuning. The
            base weights stay frozen, so the reference is the policy with its adapter switched
            off: no second copy of the model. A dict of the same fields works too. Needs
            ``pip install "forge-lightning[peft]"``.
    """

    def __init__(
        self,
        model: str | PreTrainedModel = "embedded",
        reward: Callable[..., Any] | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        group_size: int = 8,
        clip_epsilon: float = 0.2,
        clip_epsilon_high: float | None = None,
        kl_beta: float = 0.01,
        temperature: float = 0.9,
        top_p: float = 1.0,
        top_k: int = 0,
        max_new_tokens: int = 512,
        learning_rate: float = 5e-6,
        weight_decay: float = 0.0,
        gradient_accumulation_steps: int = 4,
        max_grad_norm: float | None = 1.0,
        warmup_steps: int = 0,
        lr_schedule: Literal["cosine", "constant"] = "cosine",
        loss_type: Literal["grpo", "dapo", "dr_grpo", "forge"] = "grpo",
        advantage_scale: Literal["group", "batch", "none"] = "group",
        num_iterations: int = 1,
        train_micro_batch_size: int | None = None,
        max_prompt_length: int | None = None,
        prompt_truncation: Literal["left", "error"] = "left",
        use_chat_template: bool | None = None,
        system_prompt: str | None = None,
        on_reward_error: Literal["raise", "zero"] = "raise",
        max_consecutive_bad_steps: int = 3,
        prefix_sharing: bool = True,
        logprob_chunk_size: int | None = 8,
        gradient_checkpointing: bool = False,
        generation_backend: Literal["hf", "vllm"] = "hf",
        vllm_gpu_memory_utilization: float = 0.3,
        use_engine_logprobs: bool = False,
        peft: LoraSettings | None = None,
    ) -> None:
        super().__init__()
        # Lightning checkpoints load with weights_only=True, which refuses custom classes: the
        # hyperparameters keep the LoRA settings as a dict (load_from_checkpoint passes it back).
        settings = lora_settings(peft)
        peft = None if settings is None else asdict(settings)
        objects = [
            name for name, value in (("model", model), ("reward", reward)) if not isinstance(value, str)
        ]
        self.save_hyperparameters(ignore=["tokenizer", *objects])
        validate_hparams(self.hparams)
        if not isinstance(model, str) and tokenizer is None:
            raise ValueError("tokenizer is required when model is an already-built model object")
        self.automatic_optimization = False
        self.model_spec = model if isinstance(model, str) else None
        self.model: PreTrainedModel | None = None if isinstance(model, str) else model
        self.tokenizer = ensure_pad_token(tokenizer) if tokenizer is not None else None
        self.reward = reward if reward is not None else GSM8KAnswerReward()
        self.generator: GenerationBackend | None = None
        self.train_metrics = TrainMetrics(component_names(self.reward))
        self.val_metrics = TrainMetrics(
            component_names(self.reward), keys=("accuracy", "reward", "completion_length")
        )
        self.last_samples: list[tuple[str, str, float]] = []
        # The latest rollout's rewards (P*G,): RewardLogger's reward histogram.
        self.last_rewards: Tensor = torch.zeros(0)
        # Seconds the latest training_step spent in each phase: generate, reward, logprob (every
        # forward), backward, optimizer. Read by the throughput benchmark.
        self.last_timings: dict[str, float] = {}
        self._nonfinite_guard = NonFiniteGuard(self.hparams.max_consecutive_bad_steps)

    @override
    def configure_model(self) -> None:
        if self.model is None:
            model, tokenizer = load_model(self.model_spec)
            self.model = model
            self.tokenizer = self.tokenizer or tokenizer
        if self.hparams.peft is not None:
            self.model = apply_lora(self.model, lora_settings(self.hparams.peft))  # no-op once wrapped
        # from_pretrained leaves models in eval mode; dropout and friends must be live for training
        # (generation switches to eval and back by itself).
        self.model.train()
        if self.hparams.gradient_checkpointing and not is_checkpointing(self.model):
            set_checkpointing(self.model, True)
        if self.device_mesh is not None and not is_sharded(self.model):
            self._shard()
        if self.generator is None:
            self.generator = _generation_backend(self.hparams, self.tokenizer, self.model)

    @override
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Logits of the policy, ``(B, T, V)``."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        start = time.perf_counter()
        timings: dict[str, float] = {}
        self.last_timings = timings
        prompts, reward_kwargs = split_batch(batch)
        with timed(timings, "generate"):
            rollout = self.rollout(
                prompts, self._sampling(), engine_logprobs=self.hparams.use_engine_logprobs
            )
        with timed(timings, "reward"):
            rewards, components = self.score(prompts, rollout, reward_kwargs)
        advantages = group_advantages(rewards, self.hparams.group_size, scale=self.hparams.advantage_scale)
        update = self.policy_update()
        stats = update.run(rollout, advantages, self._step_optimizer)
        timings.update(update.timings)
        if self.hparams.num_iterations == 1 and self._accumulation_boundary(batch_idx):
            with timed(timings, "optimizer"):
                self._step_optimizer()
        self._track(prompts, rollout, rewards, components, stats, time.perf_counter() - start)

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        prompts, reward_kwargs = split_batch(batch)
        rollout = self.rollout(
            prompts, SamplingParams(self.hparams.max_new_tokens, greedy=True), group_size=1
        )
        rewards, components = self.score(prompts, rollout, reward_kwargs, group_size=1)
        self.val_metrics.update("reward", rewards)
        for name, values in components.items():
            self.val_metrics.update(f"rewards/{name}", values)
        self.val_metrics.update("completion_length", rollout.completion_lengths.float())
        if "references" in reward_kwargs:
            correct = GSM8KAnswerReward()(
                prompts, rollout.completions, references=reward_kwargs["references"]
            )
            self.val_metrics.update("accuracy", torch.tensor(correct.scores, device=self.device))

    @override
    def on_validation_epoch_end(self) -> None:
        values = self.val_metrics.pop()
        if values:
            self.log_dict({f"val/{k}": v for k, v in values.items()}, sync_dist=False)

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        hp = self.hparams
        optimizer, scheduler = adamw_with_schedule(
            params,
            learning_rate=hp.learning_rate,
            weight_decay=hp.weight_decay,
            warmup_steps=hp.warmup_steps,
            total_steps=self.total_optimizer_steps(),
            schedule=hp.lr_schedule,
            fused=can_fuse_adamw(
                params, precision=self.trainer.precision, sharded=self.device_mesh is not None
            ),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning does not keep the RNG states; without them a resumed run would sample other
        # completions than the uninterrupted one from the same step on.
        checkpoint["forge_rng_states"] = rng_states()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "forge_rng_states" in checkpoint:
            set_rng_states(checkpoint["forge_rng_states"])

    @override
    def configure_callbacks(self) -> list[pl.Callback]:
        return [ReferenceModel()] if self.needs_reference else []

    # -- the pieces of a step -------------------------------------------------------------------

    @property
    def needs_reference(self) -> bool:
        return self.hparams.kl_beta > 0 or self.hparams.loss_type == "forge"

    def reference_model(self) -> PreTrainedModel | None:
        """The frozen reference from the trainer's ReferenceModel callback; None when not needed."""
        callback = self.reference_callback()
        return None if callback is None else callback.require()

    def reference_callback(self) -> ReferenceModel | None:
        """The trainer's ReferenceModel callback; None when no loss term needs a reference."""
        if not self.needs_reference:
            return None
        for callback in self.trainer.callbacks:
            if isinstance(callback, ReferenceModel):
                return callback
        raise RuntimeError(
            f"kl_beta={self.hparams.kl_beta} with loss_type={self.hparams.loss_type!r} needs a reference "
            "model, but the trainer has no ReferenceModel callback; add forge_lightning.callbacks."
            "ReferenceModel() or set kl_beta=0"
        )

    def rollout(
        self,
        prompts: list[str],
        params: SamplingParams,
        group_size: int | None = None,
        engine_logprobs: bool = False,
    ) -> Rollout:
        """Sample ``group_size`` completions for each prompt (with the engine's log-probs if asked)."""
        group_size = group_size or self.hparams.group_size
        prompt_ids, prompt_mask = encode_prompts(
            self.tokenizer,
            prompts,
            use_chat_template=self.use_chat_template,
            system_prompt=self.hparams.system_prompt,
            max_prompt_length=self.hparams.max_prompt_length,
            truncation=self.hparams.prompt_truncation,
        )
        prompt_ids, prompt_mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        old_logp = None
        if engine_logprobs:
            generator: LogProbGenerationBackend = self.generator  # type: ignore[assignment]
            completion_ids, old_logp = generator.generate_with_logprobs(
                self.model, prompt_ids, prompt_mask, group_size, params
            )
        else:
            completion_ids = self.generator.generate(self.model, prompt_ids, prompt_mask, group_size, params)
        mask = completion_mask(completion_ids, self.generator_eos_ids)
        return Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids,
            completion_mask=mask,
            group_size=group_size,
            completions=decode_completions(self.tokenizer, completion_ids, mask),
            old_logp=old_logp,
        )

    def score(
        self,
        prompts: list[str],
        rollout: Rollout,
        reward_kwargs: dict[str, list[Any]],
        group_size: int | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Rewards ``(P*G,)`` and per-component scores for the rollout's completions."""
        group_size = group_size or self.hparams.group_size
        repeated = {
            key: [v for v in values for _ in range(group_size)] for key, values in reward_kwargs.items()
        }
        scored = score(
            self.reward,
            [p for p in prompts for _ in range(group_size)],
            rollout.completions,
            on_error=self.hparams.on_reward_error,
            **repeated,
        )
        # Updated every step, zero included, so every rank holds the same counters.
        self.train_metrics.update("reward_errors", torch.tensor([float(scored.num_errors)]))

        def as_tensor(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32, device=self.device)

        return as_tensor(scored.total), {name: as_tensor(v) for name, v in scored.components.items()}

    def policy_update(self) -> PolicyUpdate:
        """The loss/backward machinery for one rollout, configured from the hyperparameters."""
        prefix = self.hparams.prefix_sharing and supports_shared_prefix(self.model)
        if self.hparams.prefix_sharing and not prefix and not getattr(self, "_warned_prefix", False):
            self._warned_prefix = True
            warnings.warn(
                "prefix sharing is off for this model (no KV cache in training); using the full forward"
            )
        reference = self.reference_callback()
        return PolicyUpdate(
            policy=self.model,
            reference=None if reference is None else reference.require(),
            hparams=self.hparams,
            shared_prefix=prefix,
            backward=self.manual_backward,
            reference_scope=nullcontext if reference is None else reference.scope,
        )

    def total_optimizer_steps(self) -> int:
        """Optimizer steps of the whole fit, for the learning-rate schedule."""
        hp = self.hparams
        return total_optimizer_steps(self.trainer, hp.gradient_accumulation_steps, hp.num_iterations)

    def pop_train_metrics(self) -> dict[str, float]:
        """Means of the training metrics since the last call (reduced across ranks), then reset."""
        return self.train_metrics.pop()

    @property
    def use_chat_template(self) -> bool:
        if self.hparams.use_chat_template is not None:
            return self.hparams.use_chat_template
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def generator_eos_ids(self) -> list[int]:
        return eos_token_ids(self.tokenizer, self.model)

    def _shard(self) -> None:
        """FSDP2 over the data-parallel dimension of the mesh that ModelParallelStrategy hands over."""
        if self.device_mesh["tensor_parallel"].size() > 1:
            raise ValueError("tensor parallelism is not supported: set tensor_parallel_size=1")
        if self.hparams.generation_backend != "hf":
            raise ValueError("a sharded policy samples with generation_backend='hf' only")
        if self.hparams.peft is not None:
            raise ValueError(
                "LoRA is not supported with a sharded policy; train the adapter with DDP (its "
                "gradients are small) or drop model.peft"
            )
        shard_policy(self.model, self.device_mesh["data_parallel"])

    def _sampling(self) -> SamplingParams:
        hp = self.hparams
        return SamplingParams(hp.max_new_tokens, temperature=hp.temperature, top_p=hp.top_p, top_k=hp.top_k)

    def _accumulation_boundary(self, batch_idx: int) -> bool:
        last = batch_idx + 1 == self.trainer.num_training_batches
        return (batch_idx + 1) % self.hparams.gradient_accumulation_steps == 0 or last

    def _step_optimizer(self) -> None:
        """Clip, step, zero, schedule; skip the step when the gradient is not finite."""
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        grad_norm = gradient_norm(self.model.parameters())
        finite = self._nonfinite_guard.allows(grad_norm)
        self.train_metrics.update("skipped_steps", torch.tensor([0.0 if finite else 1.0]))
        if not finite:
            optimizer.zero_grad(set_to_none=True)
            return
        self.train_metrics.update("lr", torch.tensor([scheduler.get_last_lr()[0]]))
        self.train_metrics.update("grad_norm", grad_norm.detach().float().reshape(1))
        if self.hparams.max_grad_norm is not None:
            self.clip_gradients(
                optimizer, gradient_clip_val=self.hparams.max_grad_norm, gradient_clip_algorithm="norm"
            )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        self.generator.sync_weights(self.model)

    def _track(
        self,
        prompts: list[str],
        rollout: Rollout,
        rewards: Tensor,
        components: dict[str, Tensor],
        stats: dict[str, Tensor],
        seconds: float,
    ) -> None:
        values = step_metrics(rollout, rewards, components, stats, seconds)
        for key, value in values.items():
            self.train_metrics.update(key, value.detach().float().reshape(1))
        self.log_dict(
            {"reward": values["reward"], "kl": stats["kl"]},
            prog_bar=True,
            logger=False,
            batch_size=len(prompts),
        )
        self.last_rewards = rewards.detach().float()
        self.last_samples = [
            (prompts[i // rollout.group_size], rollout.completions[i], float(rewards[i]))
            for i in range(min(len(rollout.completions), 8))
        ]


def _generation_backend(
    hp: Any, tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel
) -> GenerationBackend:
    """The sampling engine that ``generation_backend`` names."""
    eos = eos_token_ids(tokenizer, model)
    if hp.generation_backend == "vllm":
        return VLLMGenerate(tokenizer, eos, gpu_memory_utilization=hp.vllm_gpu_memory_utilization)
    return HFGenerate(tokenizer.pad_token_id, eos)
