"""GRPOLightningModule: group rollouts, rewards and the clipped policy-gradient step in Lightning.

What one training batch does is training/step.py's (score, advantages, plan, log-probs, loss
passes, optimizer step, record); the math, grpo/; validation, evaluation/evaluator.py. The module
builds them once from its settings (settings/assembly.py) and runs them from Lightning's hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import lightning.pytorch as pl
from torch import Tensor
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from typing_extensions import override

from forge_lightning._moved import renamed_attribute
from forge_lightning.callbacks.defaults import fit_callbacks
from forge_lightning.callbacks.preemption import Preemption
from forge_lightning.callbacks.publish import publish_step, publish_validation
from forge_lightning.callbacks.step_axis import EvaluationLogStep
from forge_lightning.callbacks.trainer_view import fit_shape, fitting, step_context
from forge_lightning.data.datamodule import split_batch
from forge_lightning.evaluation.ranks import owned_samples
from forge_lightning.evaluation.sampled import TrainingRandomState, batch_sizes, run_seed, sampling_seed
from forge_lightning.evaluation.validation import NO_TEST_STEP
from forge_lightning.grpo import LossSettings
from forge_lightning.models.loading import ensure_pad_token
from forge_lightning.models.lora import LoraSettings
from forge_lightning.reporting.metrics import StepRecord
from forge_lightning.rewards.extras import RewardExtras, reward_arguments
from forge_lightning.rewards.library import GSM8KAnswerReward, RewardArgument, require_arguments
from forge_lightning.rollout.engines.base import GenerationBackend
from forge_lightning.rollout.sources import EpisodeRunner, TrainingBatch
from forge_lightning.rollout.tools.stored import EnvironmentArgument, ToolsArgument, stored_tools
from forge_lightning.run.checkpoint_io import refuse_unstored_objects
from forge_lightning.settings import assembly
from forge_lightning.settings.checks import current_names, validate_hparams
from forge_lightning.settings.groups import CHANGEABLE_ON_RESUME, GRPOSettings, check_generation_budget
from forge_lightning.settings.module_preflight import data_longest, module_preflight
from forge_lightning.settings.signature import documented_settings, save_settings, settings_signature
from forge_lightning.settings.trl_names import pointing_at_settings
from forge_lightning.training.adjustments import CHECKPOINT_KEY, Adjustments, scale_learning_rate
from forge_lightning.training.loss_passes import ReferenceSource
from forge_lightning.training.optim import rescale_schedule
from forge_lightning.training.run_state import load_run_state, save_run_state


@documented_settings
class GRPOLightningModule(pl.LightningModule):
    """GRPO fine-tuning of a HuggingFace causal LM, with manual optimization.

    Each ``training_step`` samples a group of completions per prompt, scores them, turns the
    scores into group-relative advantages and backpropagates the clipped surrogate loss with a KL
    pull toward the frozen reference (a ``ReferenceModel`` callback's). The optimizer steps every
    accumulation's worth of batches and at an epoch's end: ``trainer.global_step`` counts its steps.

    The objects it is given come first; every setting after them is a keyword declared once in
    settings/groups/ (type, default, range, resume rule and the help below), typed in
    ``self.settings`` (a :class:`~forge_lightning.settings.groups.GRPOSettings`).

    Args:
        model: a spec (``embedded``, hub id, folder, ``.gguf``, ``random:...``; models/loading.py) or
            a built HF LM.
        reward: a reward object or any ``(prompts, responses, **kwargs) -> list[float]``, or a list
            of them (their equally weighted CompositeReward); GSM8K's if None. One given by import
            path (functions, classes, their lists) is stored in the checkpoint.
        tokenizer: required when ``model`` is an object; loaded with the spec otherwise.
        peft: train a LoRA adapter (lora.LoraSettings or a dict of its fields); None trains every weight.
        tools: typed functions with docstrings (or their import paths) a completion may call, each
            result coming back as the chat template's ``tool`` message (tools/functions.py).
        environment_factory: a class, or a function returning an environment (or its import path),
            made once per completion, or a mapping name -> factory (tools/environments.py: its
            ``reset``, its score, its tools). Sync rollouts only.
        accuracy: the check behind ``val/accuracy`` (a reward scoring 1 when right); GSM8K's if None.
        answer_key: what a sampled completion votes for in maj@k, ``completion -> hashable`` (GSM8K's
            extracted number by default); None logs no maj@k.
    """

    # TRL's names (num_generations, beta, ...) and close misspellings get a pointer to the setting
    # here instead of Python's bare TypeError (settings/trl_names.py).
    @pointing_at_settings
    @settings_signature(
        after={"tools": ("tools", "environment_factory"), "validation": ("accuracy", "answer_key")}
    )
    def __init__(
        self,
        model: str | PreTrainedModel = "embedded",
        reward: RewardArgument | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        peft: LoraSettings | None = None,
        *,
        tools: ToolsArgument = None,
        environment_factory: EnvironmentArgument = None,
        accuracy: Callable[..., Any] | None = None,
        answer_key: Callable[[str], Any] | None = GSM8KAnswerReward.answer_key,
        **settings: Any,
    ) -> None:
        pl.LightningModule.__init__(self)  # not super(): save_hyperparameters would read this frame
        self.tools = stored_tools(tools, environment_factory)
        stored = assembly.stored_arguments(model, tokenizer, reward, peft, self.tools)
        save_settings(self, GRPOLightningModule.__init__, stored.hparams, settings, stored.ignored)
        validate_hparams(self.hparams)
        self.automatic_optimization = False
        self.model_spec = model if isinstance(model, str) else None
        self.model: PreTrainedModel | None = None if isinstance(model, str) else model
        self.tokenizer = ensure_pad_token(tokenizer) if tokenizer is not None else None
        # The flat hyperparameters as typed settings groups, and what is built from them, once: the
        # rollout source (where and when rollouts are sampled), the plan (what each batch trains,
        # when the optimizer steps), the step, the evaluator, the reporter (what loggers get).
        self.settings = GRPOSettings.from_hparams(self.hparams)
        parts = assembly.build_components(self.settings, stored, self.tools, accuracy, answer_key)
        self.reward, self.accuracy = parts.reward, parts.accuracy
        self.step, self.evaluator = parts.step, parts.evaluator
        self.sampling, self.greedy, self.scorer = parts.sampling, parts.greedy, parts.scorer
        self.rollout_source, self.plan, self.reporter = parts.rollout_source, parts.plan, parts.reporter
        # Submodules, so that their running means move to the policy's device with the module.
        self.train_metrics, self.val_metrics = parts.train_metrics, parts.val_metrics
        self.sandbox = parts.sandbox  # where rewards and tools run: None (threads) or workers
        self.reference: ReferenceSource | None = None  # handed over by the ReferenceModel callback
        self.last_step: StepRecord | None = None
        # The StepRecords of the optimizer steps the latest training batch took (an async batch at
        # the end of the fit trains every rollout still in flight); last_step is the last of them.
        self.batch_records: list[StepRecord] = []
        self._random_state = TrainingRandomState()  # put back after each validation of a fit
        self._log_step = EvaluationLogStep()  # the step validate's metrics reach the loggers at
        self._checkpoint_step: int | None = None  # the global_step of a checkpoint loaded outside fit
        self._preemption = Preemption()
        self._rewards_checked = False
        self.stepped = False  # whether the latest training batch ended an optimizer step (checkpoints wait)
        # Factors a callback set midway (CollapseGuard), on the loss settings the hparams give.
        self._adjustments, self._given_loss = Adjustments(), self.settings.loss

    @override
    def configure_model(self) -> None:
        precision = None if self._trainer is None else str(self.trainer.precision)
        spec, mesh, peft = self.model_spec, self.device_mesh, self.hparams.peft
        self.model, self.tokenizer = assembly.policy(
            self.model, self.tokenizer, spec, mesh, precision, self.settings, peft
        )
        assembly.prepare_rollouts(
            self.rollout_source, self.tokenizer, self.model, self.settings, self.tools,
            self.use_chat_template, self.scorer.temperature, self.sandbox, self.reward,
        )  # fmt: skip

    # The rollout source owns the engine and the episode runner (built in configure_model); one
    # set before the fit (a custom engine, a wrapped runner) is the one it uses.
    @property
    def engine(self) -> GenerationBackend | None:
        """The engine that samples the rollouts (the rollout servers' under asynchronous rollouts)."""
        return self.rollout_source.engine

    @engine.setter
    def engine(self, engine: GenerationBackend | None) -> None:
        self.rollout_source.engine = engine

    @property
    def episodes(self) -> EpisodeRunner | None:
        """The episode runner training, validation and prediction sample with."""
        return self.rollout_source.runner

    @episodes.setter
    def episodes(self, runner: EpisodeRunner | None) -> None:
        self.rollout_source.runner = runner

    generator, sampler = renamed_attribute("generator", "engine"), renamed_attribute("sampler", "episodes")

    @override
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Logits of the policy, ``(B, T, V)``."""
        if self.model is None:
            raise RuntimeError(
                f"the model {self.model_spec!r} is not loaded yet: call configure_model() first "
                "(trainer.fit, validate and predict do)"
            )
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Train on the rollouts the source gives for this batch: the batch's own, sampled now
        (sync), or those due from the servers (async; none while the pipeline fills)."""
        prompts, batch_kwargs = split_batch(batch)
        if not self._rewards_checked:  # before the first generation, so a mismatch costs nothing
            require_arguments(self.reward, reward_arguments(batch_kwargs, self.rollout_source.calls_tools))
            self._rewards_checked = True
        self.stepped, self.batch_records = False, []
        context, batch = step_context(self), TrainingBatch(prompts, batch_kwargs, batch_idx)
        for item in self.rollout_source.rollouts(batch, context, self.model):
            record, stepped = self.step.train(
                item, self.model, self.reference, self.optimizers(), self.lr_schedulers(), context
            )
            self.stepped = self.stepped or stepped
            publish_step(self, record)
            self.last_step = record
            self.batch_records.append(record)

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps a training batch takes when it steps (S x mu), so the step cadences a
        callback can keep are its multiples (HFCheckpoint's default rounds to one)."""
        return self.plan.steps_per_batch

    def report_every(self, steps: int) -> None:
        """Report to the loggers every ``steps`` optimizer steps (a RewardLogger hands over its
        ``logging_steps``, so that its JSONL and every logger agree); else ``log_every_n_steps``."""
        self.reporter.every = steps

    @property
    def loss_settings(self) -> LossSettings:
        """The loss's settings (``self.settings.loss``; the module's attribute before the groups)."""
        return self.settings.loss

    @property
    def needs_reference(self) -> bool:
        return self.settings.loss.needs_reference

    @property
    def adjustments(self) -> Adjustments:
        """The factors on the learning rate and the KL weight set midway (all 1 until ``adjust``)."""
        return self._adjustments

    def adjust(self, lr_scale: float, kl_beta_scale: float) -> Adjustments:
        """Scale the learning rate (the optimizer's rates and its schedule's peak) and the KL weight
        by these factors for the rest of the run (a CollapseGuard after a rollback). The
        hyperparameters stay as given; the factors are kept in checkpoints (``forge_adjustments``),
        so a resumed fit trains on with them. Returns the adjustments now in force."""
        scheduler = self.lr_schedulers()
        if scheduler is not None and lr_scale != 1.0:
            scale_learning_rate(scheduler, lr_scale)
        self._use_adjustments(self._adjustments.then(lr_scale, kl_beta_scale))
        return self._adjustments

    def weights_restored(self) -> None:
        """The policy's weights were put back outside a step: the rollout engine samples with them."""
        self.rollout_source.weights_updated(self.model)

    def _use_adjustments(self, adjustments: Adjustments) -> None:
        self._adjustments = adjustments
        self.settings = replace(self.settings, loss=adjustments.loss(self._given_loss))
        self.step.loss_passes.loss = self.settings.loss  # what the loss passes read at each step

    def use_reference(self, source: ReferenceSource) -> None:
        """Take the frozen reference from ``source`` (the ReferenceModel callback calls this)."""
        self.reference = source

    @property
    def use_chat_template(self) -> bool:
        setting = self.settings.prompts.use_chat_template  # None: when the tokenizer has one
        return setting if setting is not None else bool(getattr(self.tokenizer, "chat_template", None))

    @override
    def on_fit_start(self) -> None:
        fit = fit_shape(self.trainer)
        self.plan.check_fit(fit)
        check_generation_budget(self.settings, *batch_sizes(fit))  # before any step
        self.rollout_source.on_fit_start(fit, self.model, sharded=self.device_mesh is not None)
        assembly.share_policy(self.reward, self.accuracy, self.device, self.settings.prompts)
        self._random_state.save(self.device)  # the sanity check's validation leaves it as it was

    @override
    def on_train_start(self) -> None:
        # A resumed run's optimizer and schedule come back with the checkpoint's learning rate;
        # a new peak learning rate takes effect from here on (and on_load_checkpoint said so),
        # times the factor a CollapseGuard set, which the checkpoint's schedule already has.
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            total = self.plan.total_steps(fit_shape(self.trainer))
            peak = self.settings.optimizer.learning_rate * self._adjustments.lr_scale
            rescale_schedule(scheduler, peak, total)
        self.reporter.window = []
        self._checkpoint_step = None  # the trainer's global_step counts these weights' steps now
        if self.settings.preflight.enabled:  # here, where the training loader is known
            self._preflight()

    def _preflight(self) -> None:
        """The worst-case first step (settings/module_preflight.py): the fit ends now if it does not fit."""
        prompts = batch_sizes(fit_shape(self.trainer))[0] or 1
        worker = self.rollout_source.runs_a_worker  # its memory is the worker process's
        engine = None if worker else (self.engine, self.sampling)
        read_ahead = partial(data_longest, self.trainer.train_dataloader, self.episodes)
        module_preflight(
            self.settings, self.model, self.tokenizer.all_special_ids, self.step.loss_passes, engine, prompts,
            read_ahead, self.optimizers().state, self.trainer.precision_plugin.train_step_context(),
            self.device, step_context(self),
        )  # fmt: skip

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._preemption.at_batch_end(self.trainer, self.stepped)
        self._random_state.save(self.device)  # as training leaves it, should a validation follow

    @override
    def teardown(self, stage: str) -> None:
        self.stop_rollout_worker()
        if self.sandbox is not None:
            self.sandbox.close()  # a later fit starts new workers
        self._random_state.clear()
        self.reporter.every = None  # the next fit's RewardLogger, if any, hands its own

    def stop_rollout_worker(self) -> None:
        """Stop the rollout servers the trainer started, if any, and give the trainer its threads back."""
        self.rollout_source.close()

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        prompts, batch_kwargs = split_batch(batch)
        seed = sampling_seed(run_seed(), self.global_step, batch_idx, self.global_rank)
        extras = RewardExtras(self.trainer.global_step, self.trainer.current_epoch, self.trainer.max_steps)
        tools, first = self.rollout_source.calls_tools, batch_idx == 0
        self.evaluator.batch(self.episodes, self.model, prompts, batch_kwargs, seed, extras, tools, first)

    @property
    def validation_samples(self) -> list[dict[str, Any]]:
        """This rank's validation answers since the epoch began (RewardLogger writes them)."""
        return self.evaluator.samples

    @override
    def on_validation_epoch_start(self) -> None:
        self.evaluator.start(owned_samples(self.trainer.val_dataloaders, self.trainer.world_size))

    @override
    def on_validation_start(self) -> None:
        # The loaders are known now; validate without fit: a reward model moves to the policy's device.
        check_generation_budget(self.settings, *batch_sizes(fit_shape(self.trainer)))
        assembly.share_policy(self.reward, self.accuracy, self.device, self.settings.prompts)

    @override
    def on_validation_end(self) -> None:
        if fitting(self._trainer):
            self._random_state.restore()
        self._log_step.restore(self.trainer)

    @override
    def on_validation_epoch_end(self) -> None:
        values, step = self.evaluator.values(), self.evaluated_step or 0
        publish_validation(self, values, fitting(self._trainer), self._log_step, step)

    @property
    def evaluated_step(self) -> int | None:
        """The optimizer step of the weights validated: the trainer's in a fit, else a loaded
        checkpoint's (Lightning restores no global_step outside fit); None if unknown (a model spec)."""
        in_fit = fitting(self._trainer)
        if not in_fit and self._checkpoint_step is not None:
            return self._checkpoint_step
        return self.global_step if in_fit or self.global_step > 0 else None

    @override
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[str]:
        """The greedy completion of each of the batch's prompts (``trainer.predict`` returns a
        list of these lists, one per batch)."""
        prompts, rows = split_batch(batch)
        return self.episodes(self.model, prompts, self.greedy, group_size=1, rows=rows).completions

    @override
    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        raise NotImplementedError(NO_TEST_STEP)

    @override
    def setup(self, stage: str) -> None:
        if stage == "test":  # before Lightning asks the data for a test_dataloader
            raise NotImplementedError(NO_TEST_STEP)

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        total, sharded = self.plan.total_steps(fit_shape(self.trainer)), self.device_mesh is not None
        return assembly.optimizer_config(
            self.model, self.settings.optimizer, total, self.trainer.precision, sharded
        )

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> GRPOLightningModule:
        """Lightning's ``load_from_checkpoint``, refusing to stand the default model or reward in for
        one the checkpoint could not store (an object): pass ``model=``/``tokenizer=``/``reward=``."""
        refuse_unstored_objects(checkpoint_path, kwargs)
        # super() with its arguments: a bare super() puts __class__ in this frame, which Lightning's
        # save_hyperparameters (2.4) would read as the module's __init__ frame.
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        save_run_state(checkpoint, fit_shape(self.trainer), self.reporter, self.rollout_source, self.reward)
        checkpoint[CHECKPOINT_KEY] = self._adjustments.state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._checkpoint_step = checkpoint.get("global_step")
        # Resuming a fit checks and restores the run; validate or load_from_checkpoint may use other settings.
        resumed = fit_shape(self.trainer) if fitting(self._trainer) else None
        parts = self.reporter, self.rollout_source, self.reward
        saved = {**checkpoint, "hyper_parameters": current_names(checkpoint.get("hyper_parameters", {}))}
        load_run_state(saved, resumed, self.hparams, *parts, CHANGEABLE_ON_RESUME)
        if resumed is not None:  # a resumed fit trains on with the changes made midway
            self._use_adjustments(Adjustments.from_state(checkpoint.get(CHECKPOINT_KEY)))

    @override
    def configure_callbacks(self) -> list[pl.Callback]:
        return fit_callbacks(self._trainer, self.needs_reference, self.rollout_source.runs_a_worker)
