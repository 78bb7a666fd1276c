"""TRL's ``GRPOConfig`` names, and where each setting lives here: the one table behind the pointers
a TRL user gets (module keyword arguments, ``--model.*`` flags, YAML ``model:`` keys, Forge's
``GRPOConfig``), the migration table in notebooks/guide.ipynb (:func:`migration_table`, checked
equal by a test) and the test against TRL's own ``GRPOConfig`` (trl==1.16.0, in a virtual
environment of its own).

A TRL name is refused with its pointer, never taken as an alias: one name per setting keeps the
saved config, the checkpoints and the help to one vocabulary. Nothing heavy is imported here.
"""

from __future__ import annotations

import functools
import inspect
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

# TRL's name -> ours, as the flag that sets it without its "--" ("model.kl_beta",
# "trainer.max_epochs", "seed_everything"), or None where nothing here does that job. Names TRL
# and this project share (temperature, loss_type, learning_rate, steps_per_generation, ...) are
# not here: they are accepted as they are (their defaults may differ: TRL_DEFAULTS).
TRL_NAMES: dict[str, str | None] = {
    # The algorithm
    "num_generations": "model.group_size",
    "max_completion_length": "model.max_new_tokens",
    "beta": "model.kl_beta",
    "epsilon": "model.clip_epsilon",
    "epsilon_high": "model.clip_epsilon_high",
    "scale_rewards": "model.advantage_scale",
    "reward_weights": "model.reward",
    "delta": None,
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
    "lr_scheduler_type": "model.lr_schedule",
    "num_train_epochs": "trainer.max_epochs",
    "max_steps": "trainer.max_steps",
    "eval_steps": "trainer.val_check_interval",
    "bf16": "trainer.precision",
    "output_dir": "trainer.default_root_dir",
    "report_to": "trainer.logger",
    "seed": "seed_everything",
    "save_steps": "hf_checkpoint.save_steps",
    "logging_steps": "reward_logger.logging_steps",
    "log_completions": "reward_logger.num_text_samples",
    "num_completions_to_print": "reward_logger.num_text_samples",
    "log_multimodal": None,
    "log_unique_prompts": None,
    "log_completions_hub_repo": None,
}

# What the guide's migration table says of a row, where the names alone would mislead.
TRL_NOTES: dict[str, str] = {
    "reward_weights": "a weight per reward: `[(fn, weight, name), ...]`",
    "generation_batch_size": "counts prompts here, completions in TRL",
    "per_device_train_batch_size": "counts prompts here, completions in TRL",
    "use_vllm": "`generation_backend: vllm`",
    "cache_implementation": "a `generation_kwargs` key",
    "vllm_importance_sampling_correction": "`mask` or `truncate`; off (None) by default",
    "vllm_importance_sampling_mode": "`token` or `sequence`; `mask`/`truncate` is `rollout_correction`",
    "model_init_kwargs": "and `attn_implementation`",
    "bf16": "`bf16-mixed`",
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


def flag(target: str) -> str:
    return f"--{target}"


def pointer(name: str, fields: Iterable[str] = ()) -> str | None:
    """The line a TRL name gets where it is not accepted (None for a name TRL lacks). ``fields``:
    the names of the place asked (Forge's GRPOConfig), shown as ``GRPOConfig.<field>`` where the
    setting is one of them."""
    if name not in TRL_NAMES:
        return None
    target = TRL_NAMES[name]
    if target is None:
        return f"TRL's `{name}` has no counterpart here"
    ours = target.rsplit(".", 1)[-1]
    where = f"GRPOConfig.{ours}" if ours in set(fields) else flag(target)
    return f"TRL's `{name}` is `{ours}` here ({where})"


def did_you_mean(name: str, accepted: Iterable[str]) -> str | None:
    """The accepted name closest to ``name`` within 2 edits (ties: the first in order), if any."""
    best, distance = None, 3
    for candidate in accepted:
        d = _edits(name, candidate, distance)
        if d < distance:
            best, distance = candidate, d
    return best


def unknown_setting(name: str, accepted: Iterable[str], fields: Iterable[str] = ()) -> str | None:
    """What to say of a setting ``name`` that is not in ``accepted``: its TRL pointer, or a
    "did you mean" for a misspelling; None when neither applies."""
    accepted = list(accepted)
    said = pointer(name, fields)
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
        refuse_unknown_keywords(type(self).__name__, kwargs, accepted, fields=fields)
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
    """The guide's tables: TRL's names and ours, the names with no counterpart, then the defaults that
    differ (markdown)."""
    rows = ["| TRL `GRPOConfig` | here | note |", "|---|---|---|"]
    for name, target in TRL_NAMES.items():
        if target is not None:
            rows.append(f"| `{name}` | `{flag(target)}` | {TRL_NOTES.get(name, '')} |")
    none = ", ".join(f"`{name}`" for name, target in TRL_NAMES.items() if target is None)
    rows += ["", *textwrap.wrap(f"No counterpart here: {none}.", 100, break_on_hyphens=False)]
    rows += ["", "| setting | TRL's default | ours |", "|---|---|---|"]
    for name, trl, target, ours in TRL_DEFAULTS:
        shown = f"`{name}`" if target.endswith(f".{name}") else f"`{name}` / `{flag(target)}`"
        rows.append(f"| {shown} | `{trl!r}` | `{ours!r}` |")
    return "\n".join(rows) + "\n"


# Keys under "--model." or a config's "model:" that are jsonargparse's own, not settings.
_PARSER_KEYS = {"help", "class_path", "init_args", "dict_kwargs"}


def refuse_foreign_settings(args: list[str], module: type) -> None:
    """Stop a command line with its pointer where a module setting it gives (``--model.<name>``,
    a config's ``model:`` keys) is a TRL name or a misspelling of one of ``module``'s settings:
    before jsonargparse's "unrecognized arguments" or its parse of every option."""
    accepted = list(inspect.signature(module.__init__).parameters)[1:]
    for name in given_model_settings(args, f"{module.__module__}.{module.__qualname__}"):
        if name not in accepted:
            said = unknown_setting(name, accepted)
            if said is not None:
                subcommand = next((a for a in args if a in ("fit", "validate", "test", "predict")), "fit")
                raise SystemExit(f"{subcommand}: {said}")


def given_model_settings(args: list[str], default_class: str) -> list[str]:
    """The module settings a command line names, in order: its ``--model.<name>`` flags and the
    ``model:`` keys of its ``--config`` files (YAML); none when it names a model class other than
    ``default_class`` (``module.Class``), whose settings are its own."""
    names: list[str] = []
    classes: list[str] = []
    for k, word in enumerate(args):
        value = args[k + 1] if k + 1 < len(args) else ""
        if word in ("--config", "-c") or word.startswith("--config="):
            section = _model_section(word.partition("=")[2] if "=" in word else value)
            classes += [section.get("class_path")] if isinstance(section.get("class_path"), str) else []
            inner = section.get("init_args", section) if "class_path" in section else section
            names += [key for key in inner if isinstance(key, str)]
        elif word.startswith("--model."):
            name = word[len("--model.") :].partition("=")[0].partition(".")[0]
            if name == "class_path":
                classes.append(word.partition("=")[2] or value)
            names.append(name)
    if any(c not in (default_class, default_class.rsplit(".", 1)[-1]) for c in classes):
        return []
    return [name for name in dict.fromkeys(names) if name not in _PARSER_KEYS]


def _model_section(path: str) -> dict[str, Any]:
    """The ``model:`` mapping of a YAML config file; empty where there is none to read (jsonargparse
    then says what is wrong with the file)."""
    import yaml  # noqa: PLC0415 (only for a command line with config files)

    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return {}
    section = config.get("model") if isinstance(config, dict) else None
    return section if isinstance(section, dict) else {}
