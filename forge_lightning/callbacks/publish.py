"""What the module hands to Lightning and its loggers: each optimizer step's record, and
validation's values, at the step of the weights they describe."""

from __future__ import annotations

import lightning.pytorch as pl

from forge_lightning.callbacks.step_axis import EvaluationLogStep
from forge_lightning.reporting.metrics import StepRecord

SHOWN = ("train/reward", "train/kl")  # in the progress bar


def publish_step(module: pl.LightningModule, record: StepRecord) -> None:
    """A training step's record: its metrics to Lightning (``module.log`` feeds the callbacks'
    ``callback_metrics`` and the progress bar), its report to the loggers at the optimizer step
    (Lightning would count batches, and re-send a logged value after every later batch of an
    accumulation). Called from ``training_step``."""
    for key, value in record.metrics.items():
        module.log(key, value, on_step=True, on_epoch=False, prog_bar=key in SHOWN, logger=False)
    for logger in module.loggers if record.report else []:
        logger.log_metrics(record.report, step=module.global_step)


def publish_validation(
    module: pl.LightningModule,
    values: dict[str, float],
    fitting: bool,
    log_step: EvaluationLogStep,
    step: int,
) -> None:
    """Validation's values (none in a sanity check: Lightning logs none either) at the step of the
    weights evaluated: in a fit the optimizer steps, sent to the loggers here (Lightning's step
    counts batches); outside one ``step`` (a checkpoint's), through Lightning's logging, which
    ``trainer.validate`` returns. Called from ``on_validation_epoch_end``."""
    if not values or module.trainer.sanity_checking:
        return
    if fitting:
        module.log_dict(values, sync_dist=False, logger=False)
        for logger in module.loggers:
            logger.log_metrics(values, step=module.global_step)
    else:
        log_step.set(module.trainer, step)
        module.log_dict(values, sync_dist=False)
