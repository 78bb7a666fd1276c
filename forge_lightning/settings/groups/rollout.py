"""The groups of what rollout/ reads: how completions are sampled, how prompts are encoded, what
samples them (the engine, the rollout servers), and the tools a completion may call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from forge_lightning.rollout.engines.generation_settings import SAMPLING_RULES
from forge_lightning.rollout.engines.registry import ENGINES
from forge_lightning.serving.devices import check_server_devices
from forge_lightning.serving.placement import ENTRIES_RULE
from forge_lightning.settings.declare import (
    POSITIVE,
    SECONDS,
    SHARE,
    Group,
    count,
    maybe_count,
    one_of,
    optional,
    setting,
)

# The arguments of apply_chat_template the rollouts set themselves (chat_template_kwargs may not).
_SET_BY_US = frozenset(
    {"conversation", "tools", "tokenize", "add_generation_prompt", "continue_final_message"}
)


def _parsers() -> Any:
    # Here, not at the top: the tools package imports transformers, which this module does not.
    from forge_lightning.rollout.tools import parsers

    return parsers


@dataclass(frozen=True)
class SamplingSettings(Group):
    """How training completions are sampled."""

    group_size: int = setting(8, check=count(2), card=True)
    """completions per prompt (G), at least 2."""
    max_new_tokens: int = setting(512, check=count(1), card=True)
    """longest completion, in tokens."""
    temperature: float = setting(0.9, check=POSITIVE, card=True)
    """sampling temperature; the loss scores at it too (``forge``: at 1)."""
    top_p: float = setting(1.0, check=SHARE)
    """nucleus sampling mass."""
    top_k: int = setting(0, check=count(0))
    """sample among the k likeliest tokens; 0 disables it."""
    min_p: float = setting(0.0, check=SAMPLING_RULES["min_p"])
    """drop tokens below this share of the likeliest one's probability; 0 disables it."""
    repetition_penalty: float = setting(1.0, check=SAMPLING_RULES["repetition_penalty"])
    """HF's and vLLM's penalty on tokens already in the sequence; 1 disables it."""
    stop: list[str] | None = setting(
        None, check=(optional(SAMPLING_RULES["stop"][0]), "None or " + SAMPLING_RULES["stop"][1])
    )
    """strings that end a completion (training and validation), the mask running through the
    token that completes the first; the reward's text ends with it."""
    generation_kwargs: dict[str, Any] | None = setting(None)
    """more settings for the engine, by its own names (``GenerationConfig`` fields for HF,
    ``vllm.SamplingParams`` for vLLM); keys the module sets itself and unknown ones are refused by
    name (rollout/engines/generation_settings.py)."""


@dataclass(frozen=True)
class PromptSettings(Group):
    """How prompts are encoded."""

    max_prompt_length: int | None = setting(None, check=maybe_count(1))
    """longer prompts are cut from the left, or refused (``prompt_truncation``); None: the model's
    context length less ``max_new_tokens``."""
    prompt_truncation: Literal["left", "error"] = setting("left", check=one_of("left", "error"))
    """``left`` (with a warning) or ``error``."""
    use_chat_template: bool | None = setting(None)
    """prompts through the tokenizer's chat template; None: when it has one."""
    system_prompt: str | None = setting(None)
    """system message for the chat template."""
    chat_template_kwargs: dict[str, Any] | None = setting(
        None,
        check=(
            optional(
                lambda v: (
                    isinstance(v, dict) and all(isinstance(k, str) for k in v) and not set(v) & _SET_BY_US
                )
            ),
            f"None or a dict of the template's variables by name, none of {sorted(_SET_BY_US)}",
        ),
    )
    """more variables for the chat template (Qwen3's ``enable_thinking``, Llama 3.1's
    ``tools_in_user_message``), passed to every rendering of prompts (training and validation) and
    tool turns; the names the rollouts set themselves (``tools``, ``add_generation_prompt``) are
    refused."""


@dataclass(frozen=True)
class EngineSettings(Group):
    """What samples the rollouts, and where: the generation engine and the rollout servers."""

    generation_backend: Literal["hf", "vllm"] = setting(
        "hf", check=(lambda v: v in ENGINES, lambda: " or ".join(map(repr, ENGINES)))
    )
    """``hf`` (the policy's ``generate``) or ``vllm`` (GPU; see rollout/engines/vllm.py)."""
    vllm_gpu_memory_utilization: float = setting(0.3, check=(lambda v: 0 < v < 1, "in (0, 1)"), resume=True)
    """the share of GPU memory the vLLM engine may take."""
    rollout_precision: Literal["int8", "bf16"] | None = setting(
        None, check=(optional(lambda v: v in ("int8", "bf16")), "None, 'int8' or 'bf16'")
    )
    """sample with a copy of the policy in ``int8`` (int8 weights, bfloat16 activations) or ``bf16``,
    remade after every optimizer step (rollout/engines/quantized.py; each timed against float32 in
    notebooks/throughput.ipynb); needs ``rollout_correction``. None: the policy itself."""
    rollout_mode: Literal["sync", "async"] = setting("sync", check=one_of("sync", "async"))
    """``sync``, or ``async``: the rollout servers sample while the trainer trains (without
    ``rollout_servers``, one ``local:1`` server: a child process beside the trainer)."""
    max_staleness: int = setting(1, check=count(0))
    """async: optimizer steps a rollout may lag the weights it trains (k >= 0)."""
    rollout_worker_threads: int | None = setting(None, check=maybe_count(1), resume=True)
    """the CPU threads of each rollout server the trainer starts (``local:N``, ``ray:N``, and async
    mode's own ``local:1``); None: in async mode half of the trainer's, else one. The trainer keeps
    the threads its servers on this machine's CPU do not take in async mode (at least one)."""
    rollout_device: str | None = setting(None, resume=True)
    """the device of the rollout servers the trainer starts (``local:N``, and async mode's own
    ``local:1``), or a comma-separated list dealt to them round-robin (``cuda:1,cuda:2``), passed to
    ``forge-lightning serve --device``: ``cuda:N`` another GPU, ``cuda`` the trainer's own (with
    ``rollout_memory_fraction``); ``ray:N`` servers ask Ray for one GPU each where it names cuda
    (the one Ray gives), else sample on CPUs; None: each takes cuda where there is one, else the
    CPU (serving/devices.py)."""
    rollout_memory_fraction: float | None = setting(None, resume=True)
    """the GPU memory share each rollout server the trainer starts on the CUDA devices
    ``rollout_device`` lists may take (a GPU shared with the trainer)."""
    rollout_servers: list[str] | None = setting(None, check=ENTRIES_RULE, resume=True)
    """rollout servers that sample instead of this process (serving/): ``local:N`` (N
    ``forge-lightning serve`` child processes), ``host:port`` (one you started; the trainer needs
    its ``FORGE_LIGHTNING_SERVE_SECRET``) or ``ray:N`` (N Ray actors), in any mix. Each optimizer
    step's weights are pushed to them; a server that dies is counted (``server_failures``) and its
    prompts go to the others. None or empty: the engine in this process (sync), one ``local:1``
    server (async)."""
    partial_rollouts: bool = setting(False)
    """with async rollouts: weights that arrive while a completion is
    sampled take over its next tokens (AReaL's interruptible generation), each token keeping the
    version and log-prob it was sampled with for the loss's correction."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_server_devices(self.rollout_device, self.rollout_memory_fraction)  # the started servers'


@dataclass(frozen=True)
class ToolSettings(Group):
    """Tool calls in a completion (rollout/tool_sampler.py), or a user's agent (rollout/agents/);
    the module's ``tools`` and ``environment_factory`` name the functions, stored by import path."""

    calculator: Literal["annotation", "plain"] | None = setting(
        None, check=(optional(lambda v: v in ("annotation", "plain")), "None, 'annotation' or 'plain'")
    )
    """completions may call an inline calculator, ``annotation`` (GSM8K's ``<<48/2=``) or ``plain``
    (``41 + 29 =``); its answers are read, not trained on (rollout/tool_sampler.py). None: no tool."""
    max_tool_calls: int = setting(4, check=count(0))
    """with tools, the calls one completion may make."""
    tool_call_format: str = setting(
        "hermes",
        check=(
            lambda v: v in _parsers().CALL_FORMATS,
            lambda: f"one of {_parsers().format_names()} (tools/parsers.py's CALL_FORMATS)",
        ),
    )
    """how a completion writes a call (tools/parsers.py's CALL_FORMATS): ``hermes``
    (``<tool_call>{json}</tool_call>``), ``llama3_json`` (Llama 3.1/3.2's JSON reply) or
    ``qwen3_coder`` (Qwen3-Coder's ``<function=...>`` XML)."""
    tool_timeout: float | None = setting(10.0, check=SECONDS, resume=True)
    """seconds a tool call may take before it is abandoned and answered with an error (an ``async
    def`` one too, even where it blocks its event loop); under ``sandbox: thread`` its thread runs
    on, counted in ``tool_threads_abandoned`` and warned about once per process."""
    max_tool_result_chars: int = setting(10_000, check=count(1))
    """the characters of a tool's result the model reads; a longer one is cut before it is
    rendered, marked as cut and counted (``tool_results_cut``)."""
    max_parallel_tool_calls: int = setting(16, check=count(1))
    """the tool calls that run at once: the calls of every row that waits for a tool, and every
    call of one turn, run concurrently up to this many (an ``async def`` tool is awaited, on an
    event loop no other call at once uses), each under ``tool_timeout``; the answers keep the order
    the calls were written."""
    agent: str | None = setting(
        None,
        check=(optional(lambda v: isinstance(v, str) and "." in v), "None or an import path (pkg.module.fn)"),
    )
    """the import path of ``async def agent(client, row) -> float``, a user's agent written
    against the OpenAI SDK, run ``group_size`` times per prompt with a client of the policy's own
    endpoint (rollout/agents/): the policy's tokens of each episode are trained, the turns the agent
    inserts are masked. Its return value is the score, with no ``reward`` set (or one that holds
    EnvironmentReward); with another reward it returns None. An agent that raises fails its
    episode: counted (``agent_errors``), scored 0, nothing of it trained. Sync rollouts with HF
    generate only; not with the calculator, tools or environment_factory. None: no agent."""
    agent_timeout: float | None = setting(600.0, check=SECONDS)
    """seconds an agent's episode may take; a longer one is cancelled and fails (counted in
    ``agent_errors``). None waits for ever."""
