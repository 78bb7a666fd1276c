"""Running means of the training metrics, reduced across ranks by torchmetrics."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric, SumMetric

from forge_lightning.rollout import Rollout

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
    "frac_zero_std_groups",
    "tokens_per_s",
    "lr",
    "grad_norm",
)
COUNT_KEYS = ("reward_errors", "skipped_steps")


class TrainMetrics(nn.Module):
    """Named means (and counters) since the last :meth:`pop`."""

    def __init__(self, reward_components: Iterable[str], keys: Iterable[str] = TRAIN_KEYS) -> None:
        super().__init__()
        names = list(keys) + [f"rewards/{c}" for c in reward_components]
        # Module names may not contain '.', which reward names may; '/' is fine.
        self.means = nn.ModuleDict({n.replace(".", "_"): MeanMetric() for n in names})
        self.counts = (
            nn.ModuleDict({n: SumMetric() for n in COUNT_KEYS}) if keys is TRAIN_KEYS else nn.ModuleDict()
        )

    def update(self, key: str, value: Tensor) -> None:
        key = key.replace(".", "_")
        table = self.counts if key in self.counts else self.means
        if key not in table:
            raise KeyError(f"unknown metric {key!r}")
        table[key].update(value.to(table[key].device))

    def pop(self) -> dict[str, float]:
        """Means since the last call (counters as totals), then reset. Metrics never updated are left out."""
        out: dict[str, float] = {}
        for table in (self.means, self.counts):
            for key, metric in table.items():
                if metric.update_count:
                    out[key] = float(metric.compute())
                metric.reset()
        return out


def step_metrics(
    rollout: Rollout, rewards: Tensor, components: dict[str, Tensor], stats: dict[str, Tensor], seconds: float
) -> dict[str, Tensor]:
    """One training step's values for :class:`TrainMetrics`: rewards ``(P*G,)`` and their
    components, the rollout's lengths and throughput, and the loss statistics ``stats``."""
    group_std = rewards.view(-1, rollout.group_size).std(dim=1)
    lengths = rollout.completion_lengths.float()
    return {
        "reward": rewards.mean(),
        "reward_std": rewards.std() if rewards.numel() > 1 else torch.zeros(()),
        "completion_length": lengths.mean(),
        "frac_zero_std_groups": (group_std == 0).float().mean(),
        "tokens_per_s": torch.tensor(lengths.sum().item() / max(seconds, 1e-9)),
        **{f"rewards/{name}": v.mean() for name, v in components.items()},
        **stats,
    }
