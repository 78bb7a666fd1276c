"""Range checks for the module's settings, shared by the module and the Forge-style GRPOConfig.

Each setting is checked once: the loss's own settings by :class:`~forge_lightning.grpo.LossSettings`
(built here from the same values), LoRA's by :class:`~forge_lightning.models.lora.LoraSettings`, every
other one by ``RULES``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from forge_lightning.grpo import ADVANTAGE_ESTIMATORS, ADVANTAGE_SCALES, LossSettings, scales_itself
from forge_lightning.rollout.engines.generation_settings import SAMPLING_RULES, check_engine_logprob_kwargs
from forge_lightning.rollout.engines.registry import ENGINES
from forge_lightning.training.optim import LR_SCHEDULES

log = logging.getLogger(__name__)

MODEL_DTYPES = ("float32", "auto", "bfloat16", "float16")


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


# The arguments of apply_chat_template the rollouts set themselves (chat_template_kwargs may not).
_SET_BY_US = frozenset(
    {"conversation", "tools", "tokenize", "add_generation_prompt", "continue_final_message"}
)


def _parsers() -> Any:
    # Here, not at the top: the tools package imports transformers, which this module does not.
    from forge_lightning.rollout.tools import parsers

    return parsers


# field -> (predicate, the allowed range in words, or a function that says it when asked)
RULES: dict[str, tuple[Callable[[Any], bool], str | Callable[[], str]]] = {
    "group_size": (lambda v: isinstance(v, int) and v >= 2, "an integer >= 2"),
    "temperature": (lambda v: v > 0, "> 0"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    "min_p": SAMPLING_RULES["min_p"],
    "repetition_penalty": SAMPLING_RULES["repetition_penalty"],
    "stop": (_optional(SAMPLING_RULES["stop"][0]), "None or " + SAMPLING_RULES["stop"][1]),
    "max_new_tokens": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "learning_rate": (lambda v: v > 0, "> 0"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "gradient_accumulation_steps": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "max_grad_norm": (_optional(lambda v: v > 0), "None or > 0"),
    "warmup_steps": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    "lr_schedule": (lambda v: v in LR_SCHEDULES, f"one of {LR_SCHEDULES}"),
    "advantage_scale": (lambda v: v in ADVANTAGE_SCALES, f"one of {ADVANTAGE_SCALES}"),
    "advantage_estimator": (lambda v: v in ADVANTAGE_ESTIMATORS, f"one of {ADVANTAGE_ESTIMATORS}"),
    "num_iterations": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "train_micro_batch_size": (_optional(lambda v: isinstance(v, int) and v >= 1), "None or an integer >= 1"),
    "train_micro_batch_tokens": (
        _optional(lambda v: isinstance(v, int) and v >= 1),
        "None or an integer >= 1",
    ),
    "max_prompt_length": (_optional(lambda v: isinstance(v, int) and v >= 1), "None or an integer >= 1"),
    "prompt_truncation": (lambda v: v in ("left", "error"), "'left' or 'error'"),
    "on_reward_error": (lambda v: v in ("raise", "zero"), "'raise' or 'zero'"),
    "max_consecutive_bad_steps": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "reward_timeout": (_optional(lambda v: v > 0), "None or > 0 (seconds)"),
    "model_dtype": (lambda v: v in MODEL_DTYPES, f"one of {MODEL_DTYPES}"),
    "generation_backend": (lambda v: v in ENGINES, lambda: " or ".join(map(repr, ENGINES))),
    "vllm_gpu_memory_utilization": (lambda v: 0 < v < 1, "in (0, 1)"),
    "rollout_precision": (_optional(lambda v: v in ("int8", "bf16")), "None, 'int8' or 'bf16'"),
    "logprob_chunk_size": (_optional(lambda v: isinstance(v, int) and v >= 1), "None or an integer >= 1"),
    "lm_head_chunk_size": (_optional(lambda v: isinstance(v, int) and v >= 1), "None or an integer >= 1"),
    "max_sampling_rounds": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "num_train_epochs": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "save_steps": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    "logging_steps": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "rollout_mode": (lambda v: v in ("sync", "async"), "'sync' or 'async'"),
    "max_staleness": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    "rollout_worker_threads": (_optional(lambda v: isinstance(v, int) and v >= 1), "None or an integer >= 1"),
    "calculator": (_optional(lambda v: v in ("annotation", "plain")), "None, 'annotation' or 'plain'"),
    "max_tool_calls": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    "tool_call_format": (
        lambda v: v in _parsers().CALL_FORMATS,
        lambda: f"one of {_parsers().format_names()} (tools/parsers.py's CALL_FORMATS)",
    ),
    "tool_timeout": (_optional(lambda v: v > 0), "None or > 0 (seconds)"),
    "max_tool_result_chars": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "max_parallel_tool_calls": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "chat_template_kwargs": (
        _optional(
            lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v) and not set(v) & _SET_BY_US
        ),
        f"None or a dict of the template's variables by name, none of {sorted(_SET_BY_US)}",
    ),
    "sandbox": (lambda v: v in ("thread", "process"), "'thread' or 'process'"),
    "sandbox_memory_mb": (lambda v: isinstance(v, int) and v >= 64, "an integer >= 64 (MiB)"),
    "sandbox_cpu_seconds": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "sandbox_workers": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "sandbox_env": (
        _optional(lambda v: isinstance(v, (list, tuple)) and all(isinstance(n, str) and n for n in v)),
        "None or a list of environment variables' names",
    ),
    "agent": (_optional(lambda v: isinstance(v, str) and "." in v), "None or an import path (pkg.module.fn)"),
    "agent_timeout": (_optional(lambda v: v > 0), "None or > 0 (seconds)"),
    "val_num_generations": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    "val_temperature": (lambda v: v > 0, "> 0"),
    "val_top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "val_max_new_tokens": (_optional(lambda v: isinstance(v, int) and v >= 1), "None or an integer >= 1"),
    "max_generation_tokens": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "steps_per_generation": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "rollout_correction": (_optional(lambda v: v in ("mask", "truncate")), "None, 'mask' or 'truncate'"),
    "rollout_correction_level": (lambda v: v in ("token", "sequence"), "'token' or 'sequence'"),
    "rollout_correction_cap": (_optional(lambda v: v > 1), "None or > 1"),
    "preflight_memory_gb": (_optional(lambda v: v > 0), "None or > 0 (GiB)"),
}


# Settings of the loss, passed to LossSettings (which checks them) under the same names.
LOSS_FIELDS = (
    "loss_type",
    "clip_epsilon",
    "clip_epsilon_high",
    "kl_beta",
    "importance_sampling_level",
    "kl_estimator",
    "clip_ratio_c",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "entropy_coef",
    "kl_in_reward",
    "behav_imp_weight_cap",
)
# The async worker's default correction (AReaL's: masked at behav_imp_weight_cap, token level,
# only for a rollout sampled by older weights) until rollout_correction names one.
DEFAULT_BEHAV_IMP_WEIGHT_CAP = 5.0


def loss_settings(values: Mapping[str, Any]) -> LossSettings:
    """The loss settings among ``values`` (``max_new_tokens`` is dr_grpo's constant). With
    ``rollout_correction`` set, its mode, level and cap make the correction weight; else the
    async worker's ``behav_imp_weight_cap`` (masked, token level)."""
    picked = {name: values[name] for name in LOSS_FIELDS if name in values}
    if values.get("rollout_correction") is not None:
        picked["behav_imp_weight_cap"] = values.get("rollout_correction_cap", 3.0)
        picked["rollout_correction"] = values["rollout_correction"]
        picked["rollout_correction_level"] = values.get("rollout_correction_level", "token")
    return LossSettings(**picked, max_completion_length=values.get("max_new_tokens"))


def check_setting(field: str, value: Any) -> None:
    """Raise ValueError naming ``field`` when ``value`` is outside its range in ``RULES``."""
    allowed, words = RULES[field]
    words = words() if callable(words) else words
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{field} must be finite ({words}), got {value!r}")
    try:
        ok = bool(allowed(value))
    except TypeError:
        ok = False
    if isinstance(value, bool) or not ok:
        raise ValueError(f"{field} must be {words}, got {value!r}")


def validate_hparams(values: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first field outside its allowed range."""
    for field in RULES:
        if field in values:
            check_setting(field, values[field])
    loss_settings(values)
    if values.get("num_iterations", 1) > 1 and values.get("gradient_accumulation_steps", 1) != 1:
        raise ValueError(
            "num_iterations > 1 takes one optimizer step per pass over a rollout: set "
            f"gradient_accumulation_steps to 1 (got {values['gradient_accumulation_steps']})"
        )
    if values.get("dynamic_sampling") and values.get("num_iterations", 1) > 1:
        raise ValueError(
            "dynamic_sampling steps when enough informative groups are gathered, num_iterations > 1 "
            f"after every pass: use one of them (num_iterations={values['num_iterations']})"
        )
    if values.get("steps_per_generation", 1) > 1 and values.get("dynamic_sampling"):
        raise ValueError(
            "dynamic_sampling gathers informative groups over several generations per optimizer "
            "step, steps_per_generation > 1 splits one generation into several steps: use one of "
            f"them (steps_per_generation={values['steps_per_generation']})"
        )
    _check_advantage_levers(values)
    if _tool_mode(values) is not None:
        _check_tools(values)
    if values.get("rollout_precision") is not None:
        _check_rollout_precision(values)
    if values.get("use_engine_logprobs"):
        _check_engine_logprobs(values)
    if values.get("rollout_correction") is not None:
        _check_rollout_correction(values)
    if values.get("rollout_mode") == "async":
        _check_async(values)
    _check_rollout_device(values)
    if values.get("generation_kwargs") is not None or values.get("stop"):
        _check_generation(values)


def _check_advantage_levers(values: Mapping[str, Any]) -> None:
    """The advantage estimator against the scale, and the KL in the reward against dynamic sampling."""
    estimator, scale = values.get("advantage_estimator", "grpo"), values.get("advantage_scale", "group")
    if estimator in ADVANTAGE_ESTIMATORS and scales_itself(estimator) and scale != "none":
        raise ValueError(
            f"advantage_estimator={estimator!r} divides the centred rewards by a std of its own; "
            f"advantage_scale={scale!r} would divide them a second time: set advantage_scale='none'"
        )
    if values.get("kl_in_reward") and values.get("dynamic_sampling"):
        raise ValueError(
            "kl_in_reward makes every completion's reward differ by its KL, so dynamic_sampling "
            "would find no uninformative group to drop: use one of them"
        )


# Settings asynchronous rollouts do not take yet, each with the value they need.
ASYNC_NEEDS = {
    "top_p": 1.0,  # the worker's log-probs and the loss's must be of one distribution
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "stop": None,  # the worker has no tokenizer to match strings with
    "generation_kwargs": None,
    "peft": None,
    "generation_backend": "hf",
    "use_engine_logprobs": False,
    "dynamic_sampling": False,  # its steps depend on the rewards: no fixed version per batch
    "num_iterations": 1,
    "steps_per_generation": 1,  # a batch in flight is one optimizer step's
}


def _check_async(values: Mapping[str, Any]) -> None:
    wrong = [
        f"{name}={values[name]!r}"
        for name, need in ASYNC_NEEDS.items()
        if name in values and values[name] != need
    ]
    if wrong:
        needs = ", ".join(f"{name}={need!r}" for name, need in ASYNC_NEEDS.items())
        raise ValueError(
            f"rollout_mode='async' does not support {', '.join(wrong)} yet: it needs {needs} "
            "(top_p/top_k/min_p/repetition_penalty so that the worker and the loss score the same "
            "distribution); use "
            "rollout_mode='sync' for the others"
        )


def _check_generation(values: Mapping[str, Any]) -> None:
    from forge_lightning.rollout.engines.generation_settings import check_generation_kwargs  # noqa: PLC0415

    check_generation_kwargs(values.get("generation_kwargs"), values.get("generation_backend", "hf"))
    if values.get("stop") and _tool_mode(values) is not None:
        raise ValueError(
            f"stop does not work with {_tool_mode(values)}: tool-using rollouts end their rounds "
            "at the tools' own calls; leave stop unset"
        )


def _check_rollout_device(values: Mapping[str, Any]) -> None:
    device, fraction = values.get("rollout_device"), values.get("rollout_memory_fraction")
    if (device is not None or fraction is not None) and values.get("rollout_mode", "sync") != "async":
        raise ValueError(
            "rollout_device and rollout_memory_fraction place the asynchronous rollout worker: "
            "set rollout_mode='async', or leave them unset (sync rollouts sample on the trainer's device)"
        )
    from forge_lightning.rollout.engines.weight_ring import check_rollout_device

    check_rollout_device(device, fraction)


def _tool_mode(values: Mapping[str, Any]) -> str | None:
    """The tools a run's completions call, as the setting that names them; ValueError for two."""
    modes = [
        f"{name}={values[name]!r}"
        for name in ("agent", "calculator", "tools", "environment_factory")
        if values.get(name) is not None
    ]
    if values.get("agent") is not None and len(modes) > 1:
        raise ValueError(
            f"{' and '.join(modes)}: an agent runs its own tools (its calls come back to the endpoint "
            "as messages); use the agent, or the calculator/tools/environment_factory"
        )
    if values.get("calculator") is not None and len(modes) > 1:
        raise ValueError(
            f"{' and '.join(modes)}: the calculator and function tools are two ways of calling tools, "
            "one at a time; use the calculator, or tools/environment_factory"
        )
    return modes[0] if modes else None


def _check_tools(values: Mapping[str, Any]) -> None:
    """Tool-using rollouts are several generate calls (rollout/tool_sampler.py: in this process on
    HF generate or vLLM, or in the rollout worker; rollout/agents/runner.py: in this process on HF
    generate only); an agent is an importable async function."""
    if values.get("agent") is not None:
        from forge_lightning.rollout.agents.runner import load_agent  # aiohttp: only with an agent

        load_agent(values["agent"])
    # Each setting tools do not work with yet: its value, the reason, and the value that works.
    refused: dict[str, tuple[Any, str, Any]] = {}
    if values.get("agent") is not None:
        refused["rollout_mode"] = (
            "async",
            "the agent's endpoint samples with the trainer's policy in this process, not in the "
            "rollout worker",
            "sync",
        )
        refused["generation_backend"] = (
            "vllm",
            "an agent's endpoint samples with the policy's HF generate",
            "hf",
        )
    elif values.get("environment_factory") is not None:
        refused["rollout_mode"] = (
            "async",
            "an environment lives in the rollout worker that ran its episode, and its reward would "
            "need it in the trainer",
            "sync",
        )
    elif values.get("sandbox") == "process" and values.get("tools") is not None:
        refused["rollout_mode"] = (
            "async",
            "the rollout worker runs the tools in its own process, not in sandbox='process' workers",
            "sync",
        )
    for name, (value, why, works) in refused.items():
        if values.get(name) == value:
            raise ValueError(
                f"{_tool_mode(values)} does not work with {name}={value!r}: {why}; use {name}={works!r}"
            )
    if values.get("agent") is not None:
        for name, on in (
            ("use_engine_logprobs", values.get("use_engine_logprobs")),
            ("rollout_correction", values.get("rollout_correction") is not None),
        ):
            if on:
                raise ValueError(
                    f"{_tool_mode(values)} does not work with {name}: the agent's endpoint reports "
                    f"no log-probs of the tokens it samples; unset {name}"
                )


def _check_engine_logprobs(values: Mapping[str, Any]) -> None:
    """The engine's scores stand in for the old policy's log-probs: only where they are of the
    distribution the loss scores (the whole one, at the loss's temperature)."""
    cut = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    if any(values.get(name, off) != off for name, off in cut.items()):
        raise ValueError(
            "use_engine_logprobs needs top_p=1, top_k=0, min_p=0 and repetition_penalty=1: the "
            "engine reports log-probs of the changed distribution it sampled from, the loss "
            "computes them over the model's own"
        )
    check_engine_logprob_kwargs(values.get("generation_kwargs"), values.get("generation_backend", "hf"))
    if values.get("loss_type") == "forge":
        raise ValueError(
            "use_engine_logprobs does not go with loss_type='forge', which scores at temperature 1 "
            "while the engine reports log-probs at the sampling temperature"
        )
    if values.get("rollout_correction") is not None:
        raise ValueError(
            "use_engine_logprobs trusts the engine's log-probs as the old policy's; "
            f"rollout_correction={values['rollout_correction']!r} measures them against the "
            "trainer's instead: use one of them"
        )


def _check_rollout_precision(values: Mapping[str, Any]) -> None:
    """A low-precision sampler's log-probs are not the policy's: the loss must correct for them."""
    precision = values["rollout_precision"]
    if values.get("rollout_correction") is None:
        raise ValueError(
            f"rollout_precision={precision!r} samples with a copy whose log-probs differ from the "
            "policy's; the loss must weigh them: set rollout_correction ('truncate' or 'mask')"
        )
    if values.get("generation_backend", "hf") != "hf":
        raise ValueError(
            f"rollout_precision={precision!r} samples with HF generate on a copy of the policy; "
            f"generation_backend={values['generation_backend']!r} has its own: set generation_backend='hf'"
        )


def _check_rollout_correction(values: Mapping[str, Any]) -> None:
    if values.get("loss_type") == "forge":
        raise ValueError(
            "rollout_correction does not go with loss_type='forge' (Forge's ratio is against the "
            "reference, not the sampler); use grpo, dapo or dr_grpo"
        )
    cap = values.get("behav_imp_weight_cap", DEFAULT_BEHAV_IMP_WEIGHT_CAP)
    if cap != DEFAULT_BEHAV_IMP_WEIGHT_CAP:
        raise ValueError(
            f"behav_imp_weight_cap={cap!r} is the cap of the async worker's default correction; "
            "with rollout_correction set, its cap is rollout_correction_cap"
        )
