"""The module's settings, each declared once as a field of its group (settings/declare.py): name,
type, default, range, whether a resume may change it, and its help (the docstring under it). The
groups are filed by the layer that reads them: rollout.py (rollout/), training.py (grpo/ and
training/), scoring.py (rewards/, the sandbox, evaluation/).

:class:`GRPOSettings` is built once from the flat hyperparameters (``--model.<name>``, a config's
``model:`` keys, a checkpoint's ``hparams``); each group is a frozen dataclass that checks its own
fields' ranges when it is made. The module's signature and help (settings/signature.py), the
range checks (:data:`RULES`, which checks.py adds GRPOConfig's to) and the resume rules
(:data:`CHANGEABLE_ON_RESUME`) are read from the fields; a setting's former name (a group's
``old_names``) is read as the setting it became by :func:`current_names`. The checks across
fields and groups stay in :func:`~forge_lightning.settings.checks.validate_hparams`. A
collaborator takes its group, not the flat mapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from forge_lightning._moved import renamed
from forge_lightning.grpo import LossSettings
from forge_lightning.settings.declare import Group, OldName, Rule, attribute_docs, setting_name
from forge_lightning.settings.groups.rollout import (
    EngineSettings,
    PromptSettings,
    SamplingSettings,
    ToolSettings,
)
from forge_lightning.settings.groups.scoring import RewardSettings, SandboxSettings, ValidationSettings
from forge_lightning.settings.groups.training import (
    ASYNC_CAP,
    CORRECTION_CAP,
    LOSS_FIELDS,
    MODEL_DTYPES,
    AdvantageSettings,
    DynamicSamplingSettings,
    LossGroup,
    MemorySettings,
    OffPolicySettings,
    OptimizerSettings,
    PreflightSettings,
    loss_settings,
)

__all__ = ["ASYNC_CAP", "CORRECTION_CAP", "LOSS_FIELDS", "MODEL_DTYPES", "loss_settings", "setting_name"]


__getattr__ = renamed(__name__, {"DEFAULT_BEHAV_IMP_WEIGHT_CAP": "ASYNC_CAP"})  # its name before the one cap

# Every group but the loss's, by its attribute of GRPOSettings.
GROUPS: dict[str, type[Group]] = {
    "sampling": SamplingSettings,
    "prompts": PromptSettings,
    "advantages": AdvantageSettings,
    "off_policy": OffPolicySettings,
    "optimizer": OptimizerSettings,
    "dynamic_sampling": DynamicSamplingSettings,
    "engine": EngineSettings,
    "memory": MemorySettings,
    "rewards": RewardSettings,
    "tools": ToolSettings,
    "sandbox": SandboxSettings,
    "validation": ValidationSettings,
    "preflight": PreflightSettings,
}
# Every declaring group, in GRPOSettings' order (the module's signature follows it).
DECLARED: dict[str, type[Group]] = {
    name: LossGroup if name == "loss" else GROUPS[name]
    for name in ("sampling", "prompts", "loss", *list(GROUPS)[2:])
}


def declared_fields(declared: Mapping[str, type] = DECLARED) -> list[tuple[str, Any]]:
    """(group, field) of every setting ``declared`` (groups by name), in the signature's order."""
    return [(group, item) for group, kind in declared.items() for item in fields(kind)]


def setting_help(declared: Mapping[str, type] = DECLARED) -> dict[str, str]:
    """Every setting's help (its field's attribute docstring), by the module's name, and each
    former name's after its group's settings."""
    found = {}
    for kind in declared.values():
        docs = attribute_docs(kind)
        found |= {setting_name(item): docs[item.name] for item in fields(kind)}
        found |= {old.name: old.help() for old in kind.old_names}
    return found


def old_names_of(declared: Mapping[str, type] = DECLARED) -> list[tuple[OldName, Any]]:
    """(former name, the field of the setting it became) of every group ``declared``."""
    found = []
    for kind in declared.values():
        by_name = {setting_name(item): item for item in fields(kind)}
        found += [(old, by_name[old.new]) for old in kind.old_names]
    return found


def current_names(values: Mapping[str, Any], declared: Mapping[str, type] = DECLARED) -> dict[str, Any]:
    """The flat settings ``values`` (keywords, a config's, a checkpoint's hparams) with each former
    name's value given to the setting it became (a DeprecationWarning where it says something;
    ValueError where both are given and differ)."""
    found = dict(values)
    for old, item in old_names_of(declared):
        found = old.applied(found, item.default)
    return found


def rules_of(declared: Mapping[str, type] = DECLARED) -> dict[str, Rule]:
    """Each checked setting's range (its field's ``check``), by the module's name."""
    return {
        setting_name(item): item.metadata["check"]
        for _, item in declared_fields(declared)
        if "check" in item.metadata
    }


def changeable_of(declared: Mapping[str, type] = DECLARED) -> frozenset[str]:
    """The settings a resumed run may change: those declared ``resume=True``."""
    return frozenset(
        setting_name(item) for _, item in declared_fields(declared) if item.metadata.get("resume")
    )


def card_settings(declared: Mapping[str, type] = DECLARED) -> tuple[str, ...]:
    """The settings a checkpoint's model card lists (declared ``card=True``), in their order."""
    return tuple(setting_name(item) for _, item in declared_fields(declared) if item.metadata.get("card"))


RULES = rules_of()
# Settings a resumed run may change: they leave what a step computes alone (memory, speed, error
# handling, what validation samples), or, the learning rate and its schedule, take effect from the
# resumed step on (optim.rescale_schedule). Every other module setting must match the checkpoint's.
CHANGEABLE_ON_RESUME = changeable_of()

G = TypeVar("G", bound=Group)


def picked(kind: type[G], values: Mapping[str, Any]) -> G:
    """The group ``kind`` of the flat settings ``values``; a setting they lack takes its default."""
    names = {item.name: setting_name(item) for item in fields(kind)}
    return kind(**{name: values[setting] for name, setting in names.items() if setting in values})


def flat_values(group: Group) -> dict[str, Any]:
    """A group's settings by the module's names (``--model.<name>``)."""
    return {setting_name(item): getattr(group, item.name) for item in fields(group)}


@dataclass(frozen=True)
class GRPOSettings:
    """Every setting of GRPOLightningModule but the objects it is given (model, reward, tokenizer,
    LoRA, tools, accuracy and answer key), by group; build it with :meth:`from_hparams`."""

    sampling: SamplingSettings
    prompts: PromptSettings
    loss: LossSettings  # as loss_settings builds it, with the correction's cap
    advantages: AdvantageSettings
    off_policy: OffPolicySettings
    optimizer: OptimizerSettings
    dynamic_sampling: DynamicSamplingSettings
    engine: EngineSettings
    memory: MemorySettings
    rewards: RewardSettings
    tools: ToolSettings
    sandbox: SandboxSettings
    validation: ValidationSettings
    preflight: PreflightSettings

    @classmethod
    def from_hparams(cls, values: Mapping[str, Any]) -> GRPOSettings:
        """The groups of the module's flat hyperparameters ``values``. A key they lack (a
        checkpoint written before the setting existed) takes the group's default, which is the
        module's; a former name, the setting it became."""
        values = current_names(values)
        groups = {name: picked(kind, values) for name, kind in GROUPS.items()}
        every = {name: v for group in groups.values() for name, v in flat_values(group).items()}
        return cls(**groups, loss=loss_settings({**every, **values}))


def check_generation_budget(
    settings: GRPOSettings, train_prompts: int | None, val_prompts: int | None
) -> None:
    """Refuse a batch whose generation would hold more than ``max_generation_tokens`` tokens,
    counted as rows x (P + new tokens), ``P`` being ``max_prompt_length`` (0 when unset: completion
    tokens alone): a training batch of ``train_prompts`` x ``group_size`` rows and ``max_new_tokens``,
    and a sampled validation batch of ``val_prompts`` x ``val_num_generations`` rows and
    ``val_max_new_tokens``. A batch that passes can still be too big for a small machine; one that
    fails would allocate its KV cache and logits at once (a validation only after the first steps).
    A batch size not known yet (no datamodule, no loader) is not checked."""
    sampling, validation = settings.sampling, settings.validation
    prompt = settings.prompts.max_prompt_length or 0
    n, budget = validation.val_num_generations, settings.memory.max_generation_tokens
    batches = [
        ("data.prompts_per_step", train_prompts, "group_size", sampling.group_size, sampling.max_new_tokens),
        (
            "data.val_batch_size",
            val_prompts,
            "val_num_generations",
            n,
            validation.max_new_tokens(sampling.max_new_tokens),
        ),
    ]
    for prompts_name, prompts, rows_name, per_prompt, new in batches:
        tokens = (prompts or 0) * per_prompt * (prompt + new)
        if tokens > budget:
            raise ValueError(
                f"{rows_name}={per_prompt} x {prompts_name}={prompts} rows x ({prompt} prompt + {new} new "
                f"tokens) = {tokens:,} tokens in one batch's generation, over max_generation_tokens="
                f"{budget:,} (the rule: rows x (max_prompt_length, 0 when unset, + new tokens) <= "
                f"max_generation_tokens). Lower {rows_name} (at most {budget // (prompts * (prompt + new))} "
                f"here) or {prompts_name}, or raise max_generation_tokens if the machine holds it"
            )
