"""What a training step reports: running means reduced across ranks, and the record of the step."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torchmetrics import MaxMetric, MeanMetric, SumMetric

from forge_lightning.reporting.profiler import PHASES
from forge_lightning.rollout.sampler import prompt_text
from forge_lightning.rollout.types import Rollout

# Every rank must hold the same metrics in the same order, or the cross-rank reduction in
# ``compute`` would wait forever: so the keys are fixed when the module is built.
TRAIN_KEYS = (
    "loss",
    "policy_loss",
    "reward",
    "reward_std",
    "kl",
    "clip_fraction",
    "clip_fraction_low",
    "clip_fraction_high",
    "completion_length",
    "completion_length_finished",
    "completion_length_truncated",
    "truncated_fraction",
    "frac_zero_std_groups",
    "sampling_rounds",
    "groups_dropped",
    "entropy",
    "lr",
    "grad_norm",
    # Asynchronous rollouts: the optimizer steps between the weights that sampled a trained
    # rollout and the weights it trained. Rollout correction (and async): the sampler's KL from
    # the trainer and the correction weights (grpo.grpo_loss).
    "staleness",
    "sampler_kl",
    "correction_weight_mean",
    "correction_masked_fraction",
    # Tool-using rollouts (rollout/tool_sampler.py), per completion: calls, calls that failed, generate
    # rounds, results cut to their length cap, calls abandoned at their time limit whose threads run
    # on in the trainer's process (a thread sandbox), and the share of the completion's tokens a tool
    # wrote; and ``tool_calls/<name>``, each tool's calls (RunningMetrics' ``tools``).
    "tool_calls",
    "tool_errors",
    "turns",
    "tool_results_cut",
    "tool_threads_abandoned",
    "tool_token_fraction",
    # Agent rollouts (rollout/agents/runner.py), per episode: failed (1) or not, and its calls
    # served but not trained (outside its chain, refused, or answered empty past its budget).
    "agent_errors",
    "agent_calls_dropped",
)
# Maxima over the step's batches (and a report's steps).
MAX_KEYS = ("staleness_max",)
# Seconds per phase (from the PhaseProfiler) and completion tokens per second of those seconds.
# With asynchronous rollouts, the seconds the trainer waited for a rollout.
# The share of the loss forwards' tokens that were padding (rollout/micro_batches.py).
PERF_KEYS = (
    *(f"{phase}_s" for phase in PHASES),
    "step_s",
    "tokens_per_s",
    "rollout_wait_s",
    "padding_fraction",
)
# ``groups_filtered``: groups a loop hook dropped (training/loop_hooks.py), logged when one may.
# ``server_failures``: rollout servers found dead (serving/client.py), each by each rank that found it.
COUNT_KEYS = (
    "reward_errors",
    "skipped_steps",
    "num_tokens",
    "empty_steps",
    "regenerated",
    "groups_filtered",
    "server_failures",
)
# The loss statistics of a backward pass (add_micro_batch).
LOSS_STATS = (
    "loss",
    "policy_loss",
    "kl",
    "clip_fraction",
    "clip_fraction_low",
    "clip_fraction_high",
    "entropy",
)


def logged_name(key: str) -> str:
    """The name a metric is logged under: ``perf/...`` for PERF_KEYS, ``train/...`` otherwise."""
    return f"perf/{key}" if key in PERF_KEYS else f"train/{key}"


# Logged as running totals (the module adds each step's count): a report takes the latest.
RUNNING_TOTALS = ("num_tokens",)
# The learning rate: a batch's and a report's is its last optimizer step's, the rate the
# optimizer used at the step it is logged at (a batch split into shares takes several),
# never an average of rates no step used. LearningRateMonitor logs the same rate at that step
# (callbacks/step_axis.py).
LATEST_KEYS = ("lr",)


def window_values(window: list[dict[str, float]]) -> dict[str, float]:
    """One report of several optimizer steps' logged metrics: each mean's mean over the steps
    that have it, each counter's total, each running total's and the learning rate's latest value."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for metrics in window for k in metrics):
        values = [m[key] for m in window if key in m]
        name = key.split("/", 1)[-1]
        if name in RUNNING_TOTALS or name in LATEST_KEYS:
            out[key] = values[-1]
        elif name in COUNT_KEYS:
            out[key] = sum(values)
        elif name in MAX_KEYS:
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    return out


class RunningMetrics(nn.Module):
    """Named means (and counters) since the last :meth:`pop`: training's, reduced across ranks at
    each optimizer step, and validation's, at each validation's end."""

    def __init__(
        self, reward_components: Iterable[str], keys: Iterable[str] | None = None, tools: Iterable[str] = ()
    ) -> None:
        super().__init__()
        counted = keys is None
        names = list((*TRAIN_KEYS, *PERF_KEYS) if keys is None else keys)
        names += [f"rewards/{c}{suffix}" for c in reward_components for suffix in ("", "_std")]
        names += [f"tool_calls/{tool}" for tool in tools]  # each tool's calls per completion
        # Module names may not contain '.', which reward names may; '/' is fine.
        self.means = nn.ModuleDict({n.replace(".", "_"): MeanMetric() for n in names})
        self.counts = nn.ModuleDict({n: SumMetric() for n in COUNT_KEYS}) if counted else nn.ModuleDict()
        self.maxima = nn.ModuleDict({n: MaxMetric() for n in MAX_KEYS}) if counted else nn.ModuleDict()
        self.reward_logged: set[str] = set()  # names a reward's log_metric added (add_logged)

    def update(self, key: str, value: Tensor) -> None:
        key = key.replace(".", "_")
        table = self.counts if key in self.counts else self.maxima if key in self.maxima else self.means
        if key not in table:
            raise KeyError(f"unknown metric {key!r}")
        value = value.detach().float().reshape(-1)
        if key.startswith("rewards/"):
            value = value[~value.isnan()]  # a component's None ("not applicable") counts nowhere
        if key in LATEST_KEYS:
            table[key].reset()  # the latest value alone (every rank updates it alike)
        table[key].update(value.to(table[key].device))

    def add(self, values: Mapping[str, Tensor | float]) -> None:
        """:meth:`update` each named value (a number or a tensor of them)."""
        for key, value in values.items():
            self.update(key, value if isinstance(value, Tensor) else torch.tensor([float(value)]))

    def add_logged(self, values: Mapping[str, float], stage: str) -> None:
        """Means a reward logged with ``log_metric`` (rewards/extras.py) under names of its own,
        each a metric from its first value on; ValueError for a name the module logs itself
        (``stage``: where it is logged, ``train`` or ``val``). Every rank must log the same names
        (as in TRL): each joins the ranks' reduction in :meth:`pop`."""
        own = {*self.means, *self.counts, *self.maxima} - self.reward_logged
        for name in sorted(values):  # one order on every rank
            key = name.replace(".", "_")
            if key in own:
                raise ValueError(
                    f"log_metric({name!r}, ...) from a reward: {stage}/{name} is a metric the module "
                    "logs itself; log the reward's under another name"
                )
            if key not in self.means:
                device = next(iter(self.means.values())).device
                self.means[key] = MeanMetric().to(device)
                self.reward_logged.add(key)
            self.update(key, torch.tensor([values[name]]))

    def pop(self) -> dict[str, float]:
        """Means since the last call (counters as totals), then reset. Metrics never updated, or
        updated with no value at all (the length of truncated completions when none was), are left
        out. Every rank updates the same metrics, so every rank joins the same reductions."""
        out: dict[str, float] = {}
        for table in (self.means, self.counts, self.maxima):
            for key, metric in table.items():
                if metric.update_count:
                    value = float(metric.compute())
                    if not math.isnan(value):
                        out[key] = value
                metric.reset()
        return out


TrainMetrics = RunningMetrics  # its name before it held validation's metrics too


def batch_metrics(
    rollout: Rollout,
    rewards: Tensor,
    components: dict[str, Tensor],
    stats: dict[str, Tensor],
    phases: dict[str, float],
) -> dict[str, Tensor]:
    """One training batch's values for :class:`RunningMetrics`: rewards ``(P*G,)`` and their
    components, the rollout's lengths, the loss statistics ``stats`` and, when the profiler timed
    the phases, their seconds and the completion tokens per second of them."""
    group_std = rewards.view(-1, rollout.group_size).std(dim=1)
    lengths = rollout.completion_lengths.float()
    truncated = rollout.truncation
    values = {
        "truncated_fraction": truncated.float().mean(),
        # All of the batch's lengths in each, so that the step's mean is over its completions.
        "completion_length_finished": lengths[~truncated],
        "completion_length_truncated": lengths[truncated],
        "reward": rewards.mean(),
        "reward_std": _std(rewards),
        "completion_length": lengths.mean(),
        "frac_zero_std_groups": (group_std == 0).float().mean(),
        # A component's NaN is a None, "not applicable": out of its mean and std.
        **{f"rewards/{name}": v.nanmean() for name, v in components.items()},
        **{f"rewards/{name}_std": _std(v[~v.isnan()]) for name, v in components.items()},
        **stats,
    }
    if rollout.tool_stats is not None:
        values.update({key: counts.float().mean() for key, counts in rollout.tool_stats.items()})
        written = rollout.completion_mask.sum(dim=1).float()  # model and tool tokens
        values["tool_token_fraction"] = (1 - lengths / written.clamp(min=1)).mean()
    if phases:
        seconds = sum(phases.values())
        values.update({f"{phase}_s": torch.tensor(s) for phase, s in phases.items()})
        values["step_s"] = torch.tensor(seconds)
        values["tokens_per_s"] = torch.tensor(lengths.sum().item() / max(seconds, 1e-9))
    return values


def _std(values: Tensor) -> Tensor:
    return values.std() if values.numel() > 1 else torch.zeros(())


def add_micro_batch(
    totals: dict[str, Tensor], loss: Tensor, metrics: dict[str, Tensor], weight: Tensor, token_share: Tensor
) -> None:
    """Add one micro-batch's loss statistics to ``totals``: the losses by their share of the loss,
    the per-token statistics (KL, clip fractions) by their share of the tokens."""
    parts = {"loss": loss.detach() * weight, "policy_loss": metrics["policy_loss"] * weight}
    per_token = (
        "kl",
        "clip_fraction_low",
        "clip_fraction_high",
        "entropy",
        "sampler_kl",
        "correction_weight_mean",
        "correction_masked_fraction",
    )
    parts.update({k: metrics[k] * token_share for k in per_token if k in metrics})
    for key, value in parts.items():
        totals[key] = totals.get(key, 0) + value.detach()
    totals["clip_fraction"] = totals["clip_fraction_low"] + totals["clip_fraction_high"]


@dataclass
class StepRecord:
    """What the latest training batch produced, for callbacks to read (``module.last_step``).

    Attributes:
        step: ``trainer.global_step`` after the batch (optimizer steps so far).
        rewards: (P*G,) the batch's rewards.
        completion_lengths: (P*G,) its completions' lengths, in tokens.
        samples: up to 8 (prompt, completion, reward) triples of the batch.
        sample_components: each sample's score from every reward component, by name.
        metrics: the optimizer step's metrics (means over its batches, reduced across ranks),
            under their logged names; empty for a batch that only accumulated gradients.
        report: at a reporting step (every ``logging_steps``), what the loggers got: the
            metrics of the steps since the previous report, as :func:`window_values`; else empty.
        phases: seconds per phase of the batch (empty without a PhaseProfiler).
    """

    step: int
    rewards: Tensor
    completion_lengths: Tensor
    samples: list[tuple[str, str, float]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    sample_components: list[dict[str, float]] = field(default_factory=list)
    report: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        step: int,
        prompts: list[str],
        rollout: Rollout,
        rewards: Tensor,
        metrics: dict[str, float],
        phases: dict[str, float],
        components: dict[str, Tensor] | None = None,
        report: dict[str, float] | None = None,
    ) -> StepRecord:
        shown = range(min(len(rollout.completions), 8))
        samples = [
            (prompt_text(prompts[i // rollout.group_size]), rollout.completions[i], float(rewards[i]))
            for i in shown
        ]
        parts = [{name: float(v[i]) for name, v in (components or {}).items()} for i in shown]
        lengths = rollout.completion_lengths.detach().float().cpu()
        rewards = rewards.detach().float().cpu()
        return cls(step, rewards, lengths, samples, metrics, phases, parts, report or {})
