"""Range checks for the module's settings, shared by the module and the Forge-style GRPOConfig.

Each setting is checked once: the loss's own settings by :class:`~forge_lightning.grpo.LossSettings`
(built from the same values), LoRA's by :class:`~forge_lightning.models.lora.LoraSettings`, every
other one by the range its declaration gives (``RULES``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from forge_lightning.grpo import ADVANTAGE_ESTIMATORS, scales_itself
from forge_lightning.rollout.engines.generation_settings import check_engine_logprob_kwargs
from forge_lightning.serving.devices import check_server_devices
from forge_lightning.serving.placement import parse_entry
from forge_lightning.serving.requests import not_built
from forge_lightning.settings.declare import Rule, check_value
from forge_lightning.settings.groups import LOSS_FIELDS, MODEL_DTYPES, current_names, loss_settings
from forge_lightning.settings.groups import RULES as MODULE_RULES

log = logging.getLogger(__name__)

__all__ = [
    "LOSS_FIELDS",
    "MODEL_DTYPES",
    "RULES",
    "check_setting",
    "current_names",
    "loss_settings",
    "validate_hparams",
]


def _count(v: Any) -> bool:
    return isinstance(v, int) and v >= 1


# setting -> (predicate, the allowed range in words): the module's, read from their declarations
# (settings/groups/), and GRPOConfig's and the callbacks' own.
RULES: dict[str, Rule] = {
    **MODULE_RULES,
    "num_train_epochs": (_count, "an integer >= 1"),
    "save_steps": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    "logging_steps": (_count, "an integer >= 1"),
}


def check_setting(field: str, value: Any) -> None:
    """Raise ValueError naming ``field`` when ``value`` is outside its range in ``RULES``."""
    check_value(field, value, RULES[field])


def validate_hparams(values: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first field outside its allowed range (a former name's value as
    the setting it became)."""
    values = current_names(values)
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
    if values.get("rollout_servers") or values.get("rollout_mode") == "async":
        _check_servers(values)
    if _tool_mode(values) is not None:
        _check_tools(values)
    if values.get("rollout_precision") is not None:
        _check_rollout_precision(values)
    if values.get("use_engine_logprobs"):
        _check_engine_logprobs(values)
    if values.get("rollout_correction") is not None:
        _check_rollout_correction(values)
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


# Async rollouts: a batch sampled by older weights trains with the sampler's log-probs, which
# Forge's loss cannot weigh.
STALE_BATCH_LOSS: tuple[Callable[[Mapping[str, Any]], bool], str] = (
    lambda v: v.get("loss_type") != "forge",
    "a batch sampled by older weights trains with the sampler's log-probs (grpo_loss's behav_logp), "
    "which loss_type='forge' does not take (its ratio is against the reference, at temperature 1): "
    "use grpo, dapo or dr_grpo, or rollout_mode='sync'",
)


# With rollout_servers the servers sample (serving/), in either rollout mode; in async mode they
# always do (one local:1 server where none are listed). They take every sampling setting but for
# SERVERS_NEED, and in async mode SERVERS_ASYNC_NEED:
# - top_p, top_k, min_p, repetition_penalty: a server's per-token log-probs are those of the
#   distribution it sampled from, after the cuts and the penalty, at the sampling temperature (as HF
#   generate's are in this process): the behaviour policy's. A batch sampled by older weights is
#   weighed by exp(old_logp - behav_logp) (grpo.grpo_loss's decoupled loss), which covers the cut
#   as it covers the lag; one sampled by the weights it trains (lag 0) trains as a sync rollout
#   does, the cut not weighed, unless rollout_correction weighs every batch. Neither needs
#   rollout_correction; the loss must take the sampler's log-probs at the sampling temperature
#   (loss_type below).
# - stop: the servers cut each row at its stop string and say where it ends.
# - generation_kwargs: the GenerationConfig fields the servers' decode loop builds; those it does
#   not (serving/requests.py's not_built, which the server refuses with a 400) are refused here.
# - peft: the servers get LoRA's weights merged into the base ones (serving/served_weights.py).
# - use_engine_logprobs: the servers report each token's log-prob; at lag 0 they stand in for the
#   old policy's (rollout/sources.py), a stale batch's are the sampler's as above.
# What the servers cannot do, by setting: whether the run's settings (all of them) work there, and
# why not, with what to set.
ServerRule = tuple[Callable[[Mapping[str, Any]], bool], str]

# In either rollout mode.
SERVERS_NEED: dict[str, ServerRule] = {
    "generation_backend": (
        lambda v: v.get("generation_backend", "hf") == "hf",
        "the servers sample with the engine each was started with (forge-lightning serve --engine; "
        "local:N and ray:N run hf), not this process's: leave generation_backend 'hf'",
    ),
    "rollout_device": (
        lambda v: v.get("rollout_device") is None or _starts_servers(v.get("rollout_servers") or ["local:1"]),
        "it lists the devices of the servers the trainer starts (local:N; ray:N take one GPU each "
        "from Ray where it names cuda), and these entries start none (host:port servers sample on "
        "the --device they were started with): leave rollout_device unset",
    ),
}

# The async pipeline (rollout/sources.py's AsyncRollouts) fixes, when
# it hands a batch over, the optimizer step the batch trains in: what that cannot hold stays refused.
_ONE_STEP_PER_BATCH = (
    "the async pipeline counts one optimizer step per batch it hands over, so a batch that feeds "
    "several would come back staler than the staleness bound allows and be sampled again: use "
    "rollout_mode='sync'"
)
_ENVIRONMENT_STATE = (
    "an environment is an object with state, kept with its rollout for the reward, and the batches "
    "in flight go into checkpoints as data: use rollout_mode='sync', whose tool loop runs here with "
    "the servers as its engine (the calculator and function tools do run in async mode: their loop "
    "runs here, serving/remote_episodes.py)"
)
_AGENT_ENDPOINT = (
    "a batch sampled by older weights trains with the log-probs its tokens were sampled with (the "
    "decoupled loss), and an agent's endpoint reports none (as rollout_correction and "
    "use_engine_logprobs are refused with an agent): use rollout_mode='sync', where the endpoint "
    "samples on the servers"
)

# With rollout_mode='async'.
SERVERS_ASYNC_NEED: dict[str, ServerRule] = {
    "dynamic_sampling": (
        lambda v: not v.get("dynamic_sampling"),
        "it ends an optimizer step once enough informative groups are scored, so a batch's step is "
        "known only from the rewards, after it is sampled; the async pipeline must fix it when it "
        "hands the batch over to bound its staleness: use rollout_mode='sync'",
    ),
    "num_iterations": (lambda v: v.get("num_iterations", 1) == 1, _ONE_STEP_PER_BATCH),
    "steps_per_generation": (lambda v: v.get("steps_per_generation", 1) == 1, _ONE_STEP_PER_BATCH),
    "loss_type": STALE_BATCH_LOSS,
    "environment_factory": (lambda v: not v.get("environment_factory"), _ENVIRONMENT_STATE),
    "agent": (lambda v: not v.get("agent"), _AGENT_ENDPOINT),
}


def _starts_servers(entries: list[str]) -> bool:
    return any(parse_entry(entry).kind in ("local", "ray") for entry in entries)


def _check_servers(values: Mapping[str, Any]) -> None:
    """Refuse by name, with the reason, what the rollout servers cannot do: SERVERS_NEED, and in
    async mode SERVERS_ASYNC_NEED; and generation_kwargs their decode loop builds no processor for."""
    asynchronous = values.get("rollout_mode") == "async"
    listed = values.get("rollout_servers")
    where = f"rollout_servers={listed!r}" if listed else "rollout_mode='async' (on its local:1 server)"
    rules = [(where, SERVERS_NEED)]
    if asynchronous:
        rules.append((f"{where} with rollout_mode='async'" if listed else where, SERVERS_ASYNC_NEED))
    for said, table in rules:
        for name, (works, why) in table.items():
            if not works(values):
                raise ValueError(f"{said} cannot take {name}={values.get(name)!r}: {why}")
    kwargs = values.get("generation_kwargs")
    unbuilt = not_built(kwargs.get) if isinstance(kwargs, Mapping) else []
    if unbuilt:
        raise ValueError(
            f"{where} cannot take generation_kwargs {', '.join(unbuilt)}: the servers' decode loop "
            "builds no logits processor for them (serving/requests.py; a server refuses them too); "
            "drop them, or sample in this process (no rollout_servers)"
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
    if values.get("rollout_servers") or values.get("rollout_mode") == "async":
        check_server_devices(device, fraction)  # the started servers' devices (SERVERS_NEED)
        return
    if device is not None or fraction is not None:
        raise ValueError(
            "rollout_device and rollout_memory_fraction place the rollout servers the trainer "
            "starts: set rollout_mode='async' (its local:1 server) or rollout_servers, or leave "
            "them unset (sync rollouts sample on the trainer's device)"
        )


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
    HF generate or vLLM, or on the rollout servers; rollout/agents/runner.py: in this process on HF
    generate, or on the servers in sync mode); an agent is an importable async function."""
    if values.get("agent") is not None:
        from forge_lightning.rollout.agents.runner import load_agent  # aiohttp: only with an agent

        load_agent(values["agent"])
    # Each setting tools do not work with yet: its value, the reason, and the value that works.
    refused: dict[str, tuple[Any, str, Any]] = {}
    # (An agent's and an environment's refusals in async mode are the servers': SERVERS_ASYNC_NEED.)
    if values.get("agent") is not None:
        refused["generation_backend"] = (
            "vllm",
            "an agent's endpoint samples with the policy's HF generate",
            "hf",
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
