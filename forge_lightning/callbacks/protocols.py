"""What the callbacks read of the module they run with, and hand to it: small typed protocols.

:class:`~forge_lightning.module.GRPOLightningModule` offers every one. The callbacks also work in
a user's own Trainer around any LightningModule with a ``model`` (and, for HF checkpoints, a
``tokenizer``); a module that lacks one of the others gets what the callback does for a plain
module (a batch is a step, no step records, no reference handed over). A callback asks with
``isinstance(pl_module, Protocol)``, never by probing attributes one by one.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from transformers import PreTrainedModel

from forge_lightning.reporting.metrics import StepRecord
from forge_lightning.training.adjustments import Adjustments
from forge_lightning.training.loss_passes import ReferenceSource


@runtime_checkable
class TakesReference(Protocol):
    """A module that computes its KL term against a frozen reference it is handed (ReferenceModel)."""

    def use_reference(self, source: ReferenceSource) -> None: ...


@runtime_checkable
class StepsInBatches(Protocol):
    """A module that steps its optimizer itself, so that a batch may end no step or several."""

    @property
    def stepped(self) -> bool:
        """Whether the latest training batch ended an optimizer step."""
        ...

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps a batch takes when it steps: step cadences are its multiples."""
        ...


@runtime_checkable
class ReportsSteps(Protocol):
    """A module that publishes each optimizer step's record, at a cadence a callback sets."""

    batch_records: list[StepRecord]  # the latest batch's steps (none, one or several)
    last_step: StepRecord | None

    def report_every(self, steps: int) -> None: ...


@runtime_checkable
class KeepsValidationSamples(Protocol):
    """A module whose validation keeps each answer, and knows the step of the weights it validated."""

    validation_samples: list[dict[str, Any]]

    @property
    def evaluated_step(self) -> int | None: ...


@runtime_checkable
class NamesItsModel(Protocol):
    """A module that knows where its policy came from (the model card says so)."""

    model: PreTrainedModel
    model_spec: str | None


@runtime_checkable
class RunsRollouts(Protocol):
    """A module whose rollouts may come from a worker process, stopped when a fit fails."""

    def stop_rollout_worker(self) -> None: ...


@runtime_checkable
class TakesAdjustments(Protocol):
    """A module whose weights a callback may put back (CollapseGuard's rollback) and whose learning
    rate and KL weight it may scale for the rest of the run, the change kept in its checkpoints."""

    @property
    def adjustments(self) -> Adjustments:
        """The factors on the run's settings so far (all 1 until a change)."""
        ...

    def adjust(self, lr_scale: float, kl_beta_scale: float) -> Adjustments:
        """Scale the learning rate and the KL weight from now on; the adjustments in force after."""
        ...

    def weights_restored(self) -> None:
        """The policy's weights were replaced outside a step: the rollout engine takes them."""
        ...
