"""TRL's ``GRPOTrainer`` arguments and ``GRPOConfig`` names, and where each setting lives here: the
one table behind the pointers a TRL user gets (module keyword arguments, ``--model.*`` flags, YAML
``model:`` keys, Forge's ``GRPOConfig``), the migration table in notebooks/guide.ipynb
(:func:`migration_table`, checked equal by a test) and the test against TRL's own ``GRPOConfig``
(trl==1.16.0, in a virtual environment of its own).

A TRL name is refused with its pointer, never taken as an alias: one name per setting keeps the
saved config, the checkpoints and the help to one vocabulary. TRL's names as they are go through
``forge_lightning.trl`` (its ``GRPOConfig`` and ``GRPOTrainer``), which the Python pointers name.
Nothing heavy is imported here.
"""

from __future__ import annotations

import functools
import inspect
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

# TRL's name -> ours, as the flag that sets it without its "--" ("model.kl_beta",
# "trainer.max_epochs", "seed_everything"), or None where nothing here does that job. Names TRL
# and this project share (model, temperature, loss_type, learning_rate, tools, ...) are not here:
# they are accepted as they are (their defaults may differ: TRL_DEFAULTS). A pointer says where a
# setting lives, not that its values are the same: TRL_NOTES says how they differ.

# GRPOTrainer's arguments.
TRL_TRAINER_NAMES: dict[str, str | None] = {
    "reward_funcs": "model.reward",
    "args": None,
    "train_dataset": "data.dataset",
    "eval_dataset": "data.dataset",
    "processing_class": "model.tokenizer",
    "reward_processing_classes": None,
    "callbacks": "trainer.callbacks",
    "optimizers": None,
    "peft_config": "model.peft",
    "quantization_config": None,
    "rollout_func": None,
}

# GRPOConfig's fields.
TRL_CONFIG_NAMES: dict[str, str | None] = {
    # The algorithm
    "num_generations": "model.group_size",
    "max_completion_length": "model.max_new_tokens",
    "beta": "model.kl_beta",
    "epsilon": "model.clip_epsilon",
    "epsilon_high": "model.clip_epsilon_high",
    "scale_rewards": "model.advantage_scale",
    "reward_weights": "model.reward",
    "delta": "model.clip_ratio_c",
    "multi_objective_aggregation": None,
    "top_entropy_quantile": None,
    "use_adaptive_entropy": None,
    "off_policy_mask_threshold": None,
    "use_bias_correction_kl": None,
    "sync_ref_model": None,
    "ref_model_mixup_alpha": None,
    "ref_model_sync_steps": None,
    "vespo_k_pos": None,
    "vespo_lambda_pos": None,
    "vespo_k_neg": None,
    "vespo_lambda_neg": None,
    "entropy_coef_min": None,
    "entropy_coef_max": None,
    "entropy_coef_delta": None,
    "entropy_target": None,
    "router_aux_loss_coef": None,
    # Generation
    "generation_batch_size": "data.prompts_per_step",
    "num_generations_eval": "model.val_num_generations",
    "use_vllm": "model.generation_backend",
    "vllm_mode": None,
    "vllm_model_impl": None,
    "vllm_enable_sleep_mode": None,
    "vllm_structured_outputs_regex": None,
    "vllm_server_base_url": None,
    "vllm_server_host": None,
    "vllm_server_port": None,
    "vllm_server_timeout": None,
    "vllm_group_port": None,
    "vllm_max_model_length": None,
    "vllm_tensor_parallel_size": None,
    "ds3_gather_for_generation": None,
    "use_transformers_continuous_batching": None,
    "transformers_continuous_batching_config": None,
    "cache_implementation": "model.generation_kwargs",
    "use_transformers_paged": None,
    "max_tool_calling_iterations": "model.max_tool_calls",
    # Correcting the sampler's mismatch
    "vllm_importance_sampling_correction": "model.rollout_correction",
    "vllm_importance_sampling_mode": "model.rollout_correction_level",
    "vllm_importance_sampling_cap": "model.rollout_correction_cap",
    "vllm_importance_sampling_clip_max": "model.rollout_correction_cap",
    "vllm_importance_sampling_clip_min": None,
    # The model
    "model_init_kwargs": "model.model_dtype",
    "trust_remote_code": None,
    "pad_to_multiple_of": None,
    "disable_dropout": None,
    "cast_lm_head_to_fp32": None,
    # Data, logging, the run (transformers' TrainingArguments, which GRPOConfig extends)
    "per_device_train_batch_size": "data.prompts_per_step",
    "per_device_eval_batch_size": "data.val_batch_size",
    "shuffle_dataset": "data.shuffle",
    "data_seed": "data.seed",
    "dataloader_num_workers": "data.num_workers",
    "lr_scheduler_type": "model.lr_schedule",
    "num_train_epochs": "trainer.max_epochs",
    "max_steps": "trainer.max_steps",
    "eval_strategy": "trainer.val_check_interval",
    "eval_steps": "trainer.val_check_interval",
    "bf16": "trainer.precision",
    "fp16": "trainer.precision",
    "use_cpu": "trainer.accelerator",
    "output_dir": "trainer.default_root_dir",
    "report_to": "trainer.logger",
    "seed": "seed_everything",
    "resume_from_checkpoint": "ckpt_path",
    "save_strategy": "hf_checkpoint.save_steps",
    "save_steps": "hf_checkpoint.save_steps",
    "save_total_limit": "hf_checkpoint.save_total_limit",
    "push_to_hub": None,
    "logging_steps": "reward_logger.logging_steps",
    "log_completions": "reward_logger.num_text_samples",
    "num_completions_to_print": "reward_logger.num_text_samples",
    "log_multimodal": None,
    "log_unique_prompts": None,
    "log_completions_hub_repo": None,
}

# TrainingArguments' fields that transformers 5 removed (so not GRPOConfig's there), which TRL
# scripts written for transformers 4 still set.
TRANSFORMERS_4_NAMES: dict[str, str | None] = {
    "warmup_ratio": "model.warmup_steps",
}

TRL_NAMES: dict[str, str | None] = {**TRL_TRAINER_NAMES, **TRL_CONFIG_NAMES, **TRANSFORMERS_4_NAMES}

# What a pointer adds (and the guide's migration table says) where the names alone would mislead or
# there is no counterpart to name. Markdown, read in an error message too.
TRL_NOTES: dict[str, str] = {
    "reward_funcs": "one reward or a list of them, equally weighted; weights: `[(fn, weight), ...]` or a "
    "CompositeReward",
    "args": "each of its fields is a setting of GRPOLightningModule, PromptDataModule, L.Trainer or a "
    "callback (the guide's *Coming from TRL*)",
    "train_dataset": 'a `datasets.Dataset` or `DatasetDict`; TRL\'s `prompt` column: `prompt_field="prompt"`',
    "eval_dataset": "a `DatasetDict` as `dataset`: validation reads its `val_split` split",
    "reward_processing_classes": "a RewardModel takes its own `tokenizer` (loaded with a spec)",
    "optimizers": "AdamW, set by `learning_rate`, `weight_decay`, `warmup_steps` and `lr_schedule`",
    "peft_config": "PEFT's `LoraConfig` as it is, or a dict of its fields; `task_type` CAUSAL_LM",
    "reward_weights": "a weight per reward: `[(fn, weight, name), ...]` (normalised to sum to 1)",
    "delta": "the same two-sided bound on a negative advantage's ratio, where `delta > 1 + epsilon_high` "
    "(as TRL advises)",
    "generation_batch_size": "counts prompts here, completions in TRL",
    "per_device_train_batch_size": "counts prompts here, completions in TRL (`per_device_train_batch_size "
    "/ num_generations` prompts)",
    "use_vllm": '`use_vllm=True` is `generation_backend="vllm"`',
    "cache_implementation": "a `generation_kwargs` key",
    "vllm_importance_sampling_correction": "`mask` or `truncate`; off (None) by default",
    "vllm_importance_sampling_mode": "`token` or `sequence`; `mask`/`truncate` is `rollout_correction`",
    "model_init_kwargs": "its `dtype` key; `attn_implementation` is a setting of its own",
    "lr_scheduler_type": "`cosine` or `constant`, after `warmup_steps`",
    "warmup_ratio": "a count of optimizer steps, `warmup_ratio` x the run's",
    "eval_strategy": '`eval_strategy="no"` is `limit_val_batches=0`; `"steps"` is '
    "`val_check_interval=eval_steps`",
    "bf16": '`bf16=True` is `precision="bf16-mixed"` (autocast over the float32 weights `model_dtype` '
    'loads); `"bf16-true"` casts the weights too',
    "fp16": '`fp16=True` is `precision="16-mixed"`',
    "use_cpu": '`use_cpu=True` is `accelerator="cpu"`',
    "report_to": '`report_to="none"` is `logger=False`; TensorBoard is the default logger',
    "save_strategy": '`save_strategy="steps"` saves every `save_steps`; `"no"` is `save_steps=0` (only '
    "`final/`) or no HFCheckpoint",
    "push_to_hub": "HFCheckpoint writes `save_pretrained` folders, ready to upload",
    "log_completions": "samples in TensorBoard's text tab",
}

# The defaults that differ: setting -> (TRL's name, TRL's default, our name, ours). Ours are
# Forge's, the seed this project rebuilds (a KL pull toward the reference, T 0.9, lr 5e-6,
# accumulation over 4 prompts), with GRPO's loss rather than Forge's own.
TRL_DEFAULTS: list[tuple[str, Any, str, Any]] = [
    ("loss_type", "dapo", "model.loss_type", "grpo"),
    ("beta", 0.0, "model.kl_beta", 0.01),
    ("temperature", 1.0, "model.temperature", 0.9),
    ("learning_rate", 1e-6, "model.learning_rate", 5e-6),
    ("gradient_accumulation_steps", 1, "model.gradient_accumulation_steps", 4),
    ("lr_scheduler_type", "linear", "model.lr_schedule", "cosine"),
    ("gradient_checkpointing", True, "model.gradient_checkpointing", False),
    ("max_tool_calling_iterations", None, "model.max_tool_calls", 4),
]


# How a TRL user keeps TRL's names in Python: said at the end of every Python pointer.
TRL_ROUTE = "To keep TRL's names: `from forge_lightning.trl import GRPOConfig, GRPOTrainer`"

# Where a flag's group is set in Python (``--data.dataset``: ``PromptDataModule(dataset=...)``), and
# the command's own flags, which have none.
_CALLS = {
    "model": "GRPOLightningModule",
    "data": "PromptDataModule",
    "trainer": "L.Trainer",
    "hf_checkpoint": "HFCheckpoint",
    "reward_logger": "RewardLogger",
}
_COMMAND_FLAGS = {"seed_everything": "L.seed_everything(...)", "ckpt_path": "L.Trainer.fit(ckpt_path=...)"}


def flag(target: str) -> str:
    return f"--{target}"


def python_call(target: str) -> str:
    """Where a flag's setting is given in Python: ``data.dataset`` -> ``PromptDataModule(dataset=...)``."""
    if target in _COMMAND_FLAGS:
        return _COMMAND_FLAGS[target]
    group, setting = target.split(".")
    return f"{_CALLS[group]}({setting}=...)"


def pointer(name: str, fields: Iterable[str] = (), python: bool = False) -> str | None:
    """The line a TRL name gets where it is not accepted (None for a name TRL lacks), with its note.
    ``fields``: the names of the place asked (Forge's GRPOConfig), shown as ``GRPOConfig.<field>``
    where the setting is one of them; ``python``: asked in Python, so the setting is shown as the
    call that takes it, and ``forge_lightning.trl`` is named as the way to keep TRL's names."""
    if name not in TRL_NAMES:
        return None
    target, note = TRL_NAMES[name], TRL_NOTES.get(name)
    if target is None:
        said = f"TRL's `{name}` has no counterpart here"
    else:
        ours = target.rsplit(".", 1)[-1]
        where = (
            f"GRPOConfig.{ours}" if ours in set(fields) else python_call(target) if python else flag(target)
        )
        said = f"TRL's `{name}` is `{ours}` here ({where})"
    said += f": {note}" if note else ""
    return f"{said}. {TRL_ROUTE}" if python else said


def did_you_mean(name: str, accepted: Iterable[str]) -> str | None:
    """The accepted name closest to ``name`` within 2 edits (ties: the first in order), if any."""
    best, distance = None, 3
    for candidate in accepted:
        d = _edits(name, candidate, distance)
        if d < distance:
            best, distance = candidate, d
    return best


def unknown_setting(
    name: str, accepted: Iterable[str], fields: Iterable[str] = (), python: bool = False
) -> str | None:
    """What to say of a setting ``name`` that is not in ``accepted``: its TRL pointer (``python``:
    :func:`pointer`'s), or a "did you mean" for a misspelling; None when neither applies."""
    accepted = list(accepted)
    said = pointer(name, fields, python)
    if said is not None:
        return said
    close = did_you_mean(name, accepted)
    return None if close is None else f"`{name}` is no setting here: did you mean `{close}`?"


def refuse_unknown_keywords(owner: str, kwargs: Iterable[str], accepted: Iterable[str], **kw: Any) -> None:
    """Raise a TypeError (Python's for an unexpected keyword) with the pointer of the first name of
    ``kwargs`` not in ``accepted`` that has one; names with none are left to Python's message."""
    accepted = list(accepted)
    for name in kwargs:
        if name not in accepted:
            said = unknown_setting(name, accepted, **kw)
            if said is not None:
                raise TypeError(f"{owner} got an unexpected keyword argument {name!r}: {said}")


def pointing_at_settings(init: Callable[..., None], config: bool = False) -> Callable[..., None]:
    """``init`` (an ``__init__``) refusing, before it binds its arguments, a keyword it does not
    take that is a TRL name or a close misspelling, with the pointer (:func:`unknown_setting`).
    ``config``: the class is Forge's GRPOConfig, whose fields the pointers name where they can.
    The signature stays ``init``'s (``functools.wraps``), which LightningCLI reads."""
    parameters = inspect.signature(init).parameters.values()
    accepted = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    accepted = [name for name in accepted if name != "self"]
    fields = accepted if config else ()

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        refuse_unknown_keywords(type(self).__name__, kwargs, accepted, fields=fields, python=True)
        init(self, *args, **kwargs)

    return checked


def _edits(a: str, b: str, limit: int) -> int:
    """Levenshtein distance of ``a`` and ``b``, or ``limit`` once it is that or more."""
    if abs(len(a) - len(b)) >= limit:
        return limit
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        current = [i]
        for j, y in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        if min(current) >= limit:
            return limit
        previous = current
    return min(previous[-1], limit)


def migration_table() -> str:
    """The guide's tables: TRL's names (GRPOTrainer's arguments, then GRPOConfig's fields) and ours,
    the names with no counterpart, then the defaults that differ (markdown)."""
    rows = _name_rows("TRL `GRPOTrainer(...)`", TRL_TRAINER_NAMES)
    rows += ["", *_name_rows("TRL `GRPOConfig`", {**TRL_CONFIG_NAMES, **TRANSFORMERS_4_NAMES})]
    none = ", ".join(
        f"`{name}`" for name, target in TRL_NAMES.items() if target is None and name not in TRL_NOTES
    )
    rows += ["", *textwrap.wrap(f"No counterpart here: {none}.", 100, break_on_hyphens=False)]
    rows += ["", "| setting | TRL's default | ours |", "|---|---|---|"]
    for name, trl, target, ours in TRL_DEFAULTS:
        shown = f"`{name}`" if target.endswith(f".{name}") else f"`{name}` / `{flag(target)}`"
        rows.append(f"| {shown} | `{trl!r}` | `{ours!r}` |")
    return "\n".join(rows) + "\n"


def _name_rows(header: str, names: dict[str, str | None]) -> list[str]:
    """A markdown table of ``names``: each with its flag and note, or with its note alone where it has
    no counterpart (the rest are listed apart)."""
    rows = [f"| {header} | here | note |", "|---|---|---|"]
    for name, target in names.items():
        if target is not None or name in TRL_NOTES:
            here = "none" if target is None else f"`{flag(target)}`"
            rows.append(f"| `{name}` | {here} | {TRL_NOTES.get(name, '')} |")
    return rows


# Keys under "--model." or a config's "model:" that are jsonargparse's own, not settings.
_PARSER_KEYS = {"help", "class_path", "init_args", "dict_kwargs"}


def refuse_foreign_settings(
    args: list[str], module: type, section: str = "model", every: bool = False
) -> None:
    """Stop a command line with its pointer where a setting of ``module`` it gives
    (``--<section>.<name>``, a config's ``<section>:`` keys; ``section`` ``model`` or ``data``) is a
    TRL name or a misspelling of one of ``module``'s settings: before jsonargparse's "unrecognized
    arguments" or its parse of every option. ``every``: any other name it does not take is refused
    too, in one line (a class chosen by ``--<section>``, whose unknown names jsonargparse would
    report in a many-line Union error)."""
    accepted = list(inspect.signature(module.__init__).parameters)[1:]
    for name in given_model_settings(args, f"{module.__module__}.{module.__qualname__}", section):
        if name not in accepted:
            said = unknown_setting(name, accepted)
            if said is None and every:
                listed = f"`--{section}.help {module.__name__}` lists them"
                said = f"`{name}` is no setting of {module.__name__} ({listed})"
            if said is not None:
                subcommand = next((a for a in args if a in ("fit", "validate", "test", "predict")), "fit")
                raise SystemExit(f"{subcommand}: {said}")


def given_model_settings(args: list[str], default_class: str, section: str = "model") -> list[str]:
    """The settings of ``section`` (the module's ``model``, or ``data``) a command line names, in
    order: its ``--<section>.<name>`` flags (``--model.tools+``, jsonargparse's append to a list,
    names ``tools``) and the ``<section>:`` keys of its ``--config`` files (YAML); none when it names
    a class other than ``default_class`` (``module.Class``) there, whose settings are its own."""
    names: list[str] = []
    classes: list[str] = []
    prefix = f"--{section}"
    for k, word in enumerate(args):
        value = word.partition("=")[2] if "=" in word else (args[k + 1] if k + 1 < len(args) else "")
        if word in ("--config", "-c") or word.startswith("--config="):
            config = _yaml_file(value)
            found = config.get(section) if isinstance(config, dict) else None
        elif word == prefix or word.startswith(f"{prefix}="):  # a class by name, or the group's config file
            found = _yaml_file(value) or value
        elif word.startswith(f"{prefix}."):
            found = None
            name = word[len(prefix) + 1 :].partition("=")[0].partition(".")[0].removesuffix("+")
            if name == "class_path":
                classes.append(value)
            names.append(name)
        else:
            continue
        if isinstance(found, str):
            classes.append(found)
        elif isinstance(found, dict):
            classes += [found["class_path"]] if isinstance(found.get("class_path"), str) else []
            inner = found.get("init_args", found) if "class_path" in found else found
            names += [key for key in inner or {} if isinstance(key, str)]
    if any(not _names_class(c, default_class) for c in classes):
        return []
    return [name for name in dict.fromkeys(names) if name not in _PARSER_KEYS]


def _names_class(path: str, default_class: str) -> bool:
    """Whether ``path`` (a class path or name) is ``default_class``, by any of its import paths."""
    from forge_lightning.run.specs import canonical  # noqa: PLC0415 (imports what a path names)

    return path in (default_class, default_class.rsplit(".", 1)[-1]) or canonical(path) == default_class


def _yaml_file(path: str) -> Any:
    """A YAML file's content; None where there is none to read (jsonargparse then says what is
    wrong with the file)."""
    import yaml  # noqa: PLC0415 (only for a command line with config files)

    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
