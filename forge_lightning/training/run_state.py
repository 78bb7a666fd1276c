"""What a training run adds to a Lightning checkpoint besides the weights and the optimizer: the
RNG states, the reward models' fingerprints, the trainer's settings, the tokens trained and the
asynchronous rollouts in flight; and what a resume checks and restores of them."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from forge_lightning.rewards.library import reward_parts
from forge_lightning.rewards.resume_changes import reward_on_resume
from forge_lightning.rewards.reward_model import check_reward_models, reward_model_fingerprints
from forge_lightning.run.checkpoint_io import rng_states, set_rng_states
from forge_lightning.run.fit import FitShape
from forge_lightning.run.resume import check_resume

if TYPE_CHECKING:
    from forge_lightning.reporting.reporter import StepReporter
    from forge_lightning.rollout.sources import RolloutSource


def save_run_state(
    checkpoint: dict[str, Any], fit: FitShape, reporter: StepReporter, rollouts: RolloutSource, reward: Any
) -> None:
    """What the module adds to a Lightning checkpoint (``on_save_checkpoint``). Lightning does not
    keep the RNG states; without them a resumed run would sample other completions than the
    uninterrupted one from the same step on. Reward models are kept as their folders' fingerprints."""
    checkpoint["forge_rng_states"] = rng_states()
    reward_models = reward_model_fingerprints(reward_parts(reward))
    if reward_models:
        checkpoint["forge_reward_models"] = reward_models
    checkpoint["forge_trainer_settings"] = fit.recorded()
    checkpoint["forge_tokens_trained"] = reporter.tokens_trained
    state = rollouts.state_dict()  # async: the batches in flight
    if state is not None:
        checkpoint["forge_async"] = state


def load_run_state(
    checkpoint: dict[str, Any],
    resumed: FitShape | None,
    current: Mapping[str, Any],
    reporter: StepReporter,
    rollouts: RolloutSource,
    reward: Any,
    changeable: Collection[str],
) -> None:
    """Restore what :func:`save_run_state` added (``on_load_checkpoint``); ``resumed``: the fit that
    resumes from ``checkpoint`` (its settings checked against the checkpoint's, and
    the run's state restored), None outside fit; ``current``: the module's flat hyperparameters,
    compared with those the checkpoint holds, where the names ``changeable`` may differ."""
    if resumed is not None:
        # A served reward's URL may change (warned), its other scoring arguments not (named).
        saved = reward_on_resume(checkpoint.get("hyper_parameters", {}), current)
        check_resume({**checkpoint, "hyper_parameters": saved}, current, resumed.recorded(), changeable)
        check_reward_models(checkpoint.get("forge_reward_models", []), reward_parts(reward))
        reporter.tokens_trained = float(checkpoint.get("forge_tokens_trained", 0.0))
        if "forge_async" in checkpoint:
            rollouts.load_state_dict(checkpoint["forge_async"])
    if "forge_rng_states" in checkpoint:
        set_rng_states(checkpoint["forge_rng_states"])
