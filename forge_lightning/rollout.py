"""Rollouts: prompts in, G sampled completions per prompt out, as padded token tensors."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.control_tokens import encode_marked

# SamplingParams was first defined here: it stays importable from rollout.py.
from forge_lightning.sampling import GenerationBackend, SamplingParams

# What a reward may ask for by name about each completion (Rollout.facts).
FACTS = ("completion_ids", "completion_lengths", "truncated", "tool_calls", "completions", "environments")

# A prompt: the user message as text, or a whole conversation of {"role", "content"} messages.
Prompt: TypeAlias = "str | list[dict[str, Any]]"


@dataclass
class Rollout:
    """One batch of prompts and their sampled completions.

    Completions of a prompt are contiguous: rows ``[i*G, (i+1)*G)`` of the completion tensors
    belong to prompt ``i``.
    """

    prompt_ids: Tensor  # (P, Lp) left-padded
    prompt_mask: Tensor  # (P, Lp) 1 on real prompt tokens
    completion_ids: Tensor  # (P*G, Lc) right-padded with the pad token
    completion_mask: Tensor  # (P*G, Lc) 1 up to and including the first EOS or stop string
    group_size: int
    completions: list[str]  # decoded completions, special tokens removed, P*G of them
    # (P*G, Lc) the sampling engine's log-prob of each completion token, when it reported them;
    # the loss then measures its ratio against these instead of recomputing them.
    old_logp: Tensor | None = None
    # (P*G,) True for a completion cut off at max_new_tokens, with no EOS or stop string; None: none is.
    truncated: Tensor | None = None
    # (P*G, Lc) log-probs under the older weights that sampled the rollout (asynchronous rollouts,
    # async_rollout.py), for the loss's behaviour weight; None: sampled by the weights trained.
    behav_logp: Tensor | None = None
    # (P*G, Lc) 1 where the policy sampled the token, 0 on tokens a tool wrote into the completion
    # (tool_rollout.py); None: the policy sampled every token the completion mask covers.
    model_mask: Tensor | None = None
    # Per-completion counts of a tool-using rollout, each (P*G,): ``tool_calls``, ``tool_errors``,
    # ``turns`` (generate rounds); None for a rollout of one round.
    tool_stats: dict[str, Tensor] | None = None
    # Per completion of a tool-using rollout: its calls ({name, arguments, result, ok} each), its
    # turns as TRL's messages (assistant and tool), and the environment it ran in (or None).
    tool_calls: list[list[dict[str, Any]]] | None = None
    transcripts: list[list[dict[str, Any]]] | None = None
    environments: list[Any] | None = None

    @property
    def completion_lengths(self) -> Tensor:  # (P*G,)
        """Tokens the policy sampled in each completion (a tool's tokens are not counted)."""
        if self.model_mask is None:
            return self.completion_mask.sum(dim=1)
        return (self.completion_mask.bool() & self.model_mask.bool()).sum(dim=1)

    @property
    def truncation(self) -> Tensor:  # (P*G,) bool
        if self.truncated is None:
            return torch.zeros(
                self.completion_ids.shape[0], dtype=torch.bool, device=self.completion_ids.device
            )
        return self.truncated

    def loss_mask(self, drop_truncated: bool = False) -> Tensor:
        """(P*G, Lc) bool: the completion tokens the loss weighs; without the truncated
        completions' when ``drop_truncated`` (``mask_truncated_completions``)."""
        mask = self.completion_mask.bool()
        if self.model_mask is not None:  # a tool's tokens were not sampled: no policy or KL weight
            mask = mask & self.model_mask.bool()
        return mask & ~self.truncation.unsqueeze(1) if drop_truncated else mask

    def select_groups(self, keep: Tensor) -> Rollout:
        """The rollout of the prompts where ``keep`` (P,) is True, with their G completions each."""
        rows = keep.repeat_interleave(self.group_size)  # (P*G,)
        picked = rows.nonzero().flatten().tolist()
        return Rollout(
            prompt_ids=self.prompt_ids[keep],
            prompt_mask=self.prompt_mask[keep],
            completion_ids=self.completion_ids[rows],
            completion_mask=self.completion_mask[rows],
            group_size=self.group_size,
            completions=[self.completions[i] for i in picked],
            old_logp=None if self.old_logp is None else self.old_logp[rows],
            truncated=None if self.truncated is None else self.truncated[rows],
            behav_logp=None if self.behav_logp is None else self.behav_logp[rows],
            model_mask=None if self.model_mask is None else self.model_mask[rows],
            tool_stats=None if self.tool_stats is None else {k: v[rows] for k, v in self.tool_stats.items()},
            tool_calls=_pick(self.tool_calls, picked),
            transcripts=_pick(self.transcripts, picked),
            environments=_pick(self.environments, picked),
        )

    def facts(self) -> dict[str, list]:
        """Per-completion facts a reward may ask for by naming them: ``completion_ids`` (each
        completion's tokens up to and including its EOS, a tool's among them),
        ``completion_lengths`` (tokens the policy sampled), ``truncated`` (cut off at the cap),
        and, from a tool-using rollout only, ``tool_calls`` (its calls), ``completions`` (TRL's
        messages: the assistant and tool turns) and ``environments`` (None without one). A rollout
        without tools leaves those out, so a reward's ``**kwargs`` gets what it got before tools."""
        ends = self.completion_mask.sum(dim=1).tolist()
        facts = {
            "completion_ids": [ids[:n] for ids, n in zip(self.completion_ids.tolist(), ends)],
            "completion_lengths": self.completion_lengths.tolist(),
            "truncated": self.truncation.tolist(),
        }
        if self.tool_calls is not None:
            size = len(self.completions)
            facts["tool_calls"] = self.tool_calls
            facts["completions"] = self.transcripts or [
                [{"role": "assistant", "content": c}] for c in self.completions
            ]
            facts["environments"] = self.environments or [None] * size
        return facts


def _pick(values: list[Any] | None, rows: list[int]) -> list[Any] | None:
    return None if values is None else [values[i] for i in rows]


def warn_when_few_tokens_count(rollout: Rollout) -> None:
    """Warn when under 25% of the rollout's completion tokens keep weight once the truncated
    completions are masked: the cap is likely too short for the task."""
    share = float(rollout.loss_mask(True).sum() / rollout.loss_mask().sum().clamp(min=1))
    if share < 0.25:
        warnings.warn(
            f"only {share:.0%} of this batch's completion tokens keep weight: the others belong to "
            "completions cut off at max_new_tokens (mask_truncated_completions); the cap may be too "
            "short for the task",
            stacklevel=3,
        )


def truncated_rows(completion_ids: Tensor, eos_ids: Sequence[int], max_new_tokens: int) -> Tensor:
    """(N,) True where a completion has no EOS and reached ``max_new_tokens`` tokens."""
    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_ids), device=completion_ids.device))
    return ~is_eos.any(dim=1) & torch.tensor(completion_ids.shape[1] >= max_new_tokens, device=is_eos.device)


def completion_mask(completion_ids: Tensor, eos_ids: Sequence[int]) -> Tensor:
    """1 on every completion token up to and including the first EOS, 0 after it.

    Built from EOS positions, not from ``ids != pad``: when the pad token is the EOS (as for
    SmolLM2), a pad-based mask would hide the EOS itself and the model would never learn to stop.

    completion_ids: (N, Lc) -> mask (N, Lc), same integer dtype as ``long``.
    """
    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_ids), device=completion_ids.device))
    # Count of EOS tokens strictly before each position; a token is kept while that count is 0.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return (eos_before == 0).long()


def mask_of_ends(ends: Tensor, width: int) -> Tensor:
    """(N, width) long: 1 on each row's first ``ends[i]`` positions, ``ends`` (N,)."""
    return (torch.arange(width, device=ends.device) < ends.unsqueeze(1)).long()


def cut_at_stop(text: str, stop: Sequence[str]) -> str | None:
    """``text`` up to and including the first stop string to complete in it; None if none occurs."""
    ends = [at + len(s) for s in stop if (at := text.find(s)) >= 0]
    return text[: min(ends)] if ends else None


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad token lists into ``(ids, mask)``, each ``(N, max_len)``."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq):
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq) :] = 1
    return ids, mask


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    *,
    use_chat_template: bool,
    system_prompt: str | None = None,
    max_prompt_length: int | None = None,
    truncation: str = "left",
    tools: list[dict[str, Any]] | None = None,
) -> tuple[Tensor, Tensor]:
    """Tokenize prompts (through the chat template when asked) into left-padded ``(ids, mask)``.

    A prompt is a string (the user message) or a conversation, a list of ``{"role", "content"}``
    messages (TRL's conversational format), which goes through the template as it is; its own
    system message wins over ``system_prompt``.

    Prompts longer than ``max_prompt_length`` keep their last tokens (the question and the cue to
    answer sit at the end) with a warning, or raise when ``truncation="error"``.
    """
    if use_chat_template:
        texts = [
            tokenizer.apply_chat_template(
                prompt_messages(p, system_prompt), tools=tools, tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
        # A tool environment's reset text in a message is data: its control tokens come marked
        # (control_tokens.py) and are encoded as plain text; an unmarked text encodes as before.
        token_lists = [encode_marked(tokenizer, t) for t in texts]
    else:
        if any(not isinstance(p, str) for p in prompts):
            raise ValueError(
                "a conversational prompt (a list of messages) needs the chat template: set "
                "use_chat_template to true (the tokenizer must have one), or give prompts as text"
            )
        token_lists = [tokenizer(p)["input_ids"] for p in prompts]
    if any(len(t) == 0 for t in token_lists):
        raise ValueError("a prompt encodes to zero tokens; empty prompts cannot be trained on")
    if max_prompt_length is not None:
        too_long = [i for i, t in enumerate(token_lists) if len(t) > max_prompt_length]
        if too_long and truncation == "error":
            raise ValueError(
                f"{len(too_long)} prompt(s) exceed max_prompt_length={max_prompt_length} tokens "
                f"(first: index {too_long[0]}, {len(token_lists[too_long[0]])} tokens)"
            )
        if too_long:
            warnings.warn(
                f"{len(too_long)} prompt(s) longer than max_prompt_length={max_prompt_length} tokens were "
                "truncated from the left",
                stacklevel=2,
            )
            token_lists = [t[-max_prompt_length:] for t in token_lists]
    return left_pad(token_lists, tokenizer.pad_token_id)


def prompt_messages(prompt: Prompt, system_prompt: str | None) -> list[dict[str, str]]:
    """The conversation the chat template renders for ``prompt``: a text prompt is the user
    message; ``system_prompt`` comes first unless the conversation has a system message."""
    if isinstance(prompt, str):
        conversation = [{"role": "user", "content": prompt}]
    else:
        conversation = list(prompt)
        if not conversation or not all(
            isinstance(m, dict) and {"role", "content"} <= set(m) for m in conversation
        ):
            raise ValueError(
                f"a conversational prompt is a list of {{'role', 'content'}} messages, got {prompt!r:.200}"
            )
    if not system_prompt or conversation[0]["role"] == "system":
        return conversation
    return [{"role": "system", "content": system_prompt}, *conversation]


def prompt_text(prompt: Prompt) -> str:
    """A prompt as text for logs and tables: a conversation's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return str(users[-1] if users else prompt[-1]["content"])


def decode_completions(tokenizer: PreTrainedTokenizerBase, completion_ids: Tensor, mask: Tensor) -> list[str]:
    """Decode each completion up to its first EOS, without special tokens."""
    rows = [ids[: int(n)].tolist() for ids, n in zip(completion_ids, mask.sum(dim=1))]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


@dataclass(frozen=True)
class PromptSettings:
    """How prompts become tokens: see :func:`encode_prompts`."""

    use_chat_template: bool
    system_prompt: str | None = None
    max_prompt_length: int | None = None
    truncation: Literal["left", "error"] = "left"


class RolloutSampler:
    """Prompts in, a :class:`Rollout` out: encode, sample G completions each, mask and decode.

    Built once per fit from the tokenizer, the generation engine and the prompt settings.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        generator: GenerationBackend,
        eos_ids: Sequence[int],
        prompts: PromptSettings,
    ) -> None:
        self.tokenizer = tokenizer
        self.generator = generator
        self.eos_ids = list(eos_ids)
        self.prompts = prompts

    def __call__(
        self,
        model: PreTrainedModel,
        prompts: list[Prompt],
        params: SamplingParams,
        group_size: int,
        engine_logprobs: bool = False,
        rows: dict[str, list[Any]] | None = None,
    ) -> Rollout:
        """Sample ``group_size`` completions per prompt (with the engine's log-probs if asked);
        ``rows`` (the batch's fields) are for episode runners whose tools read them."""
        prompt_ids, prompt_mask = self.encode(prompts, next(model.parameters()).device)
        if params.stop:
            return self._sample_with_ends(model, prompt_ids, prompt_mask, group_size, params, engine_logprobs)
        old_logp = None
        if engine_logprobs:
            completion_ids, old_logp = self.generator.generate_with_logprobs(  # type: ignore[attr-defined]
                model, prompt_ids, prompt_mask, group_size, params
            )
        else:
            completion_ids = self.generator.generate(model, prompt_ids, prompt_mask, group_size, params)
        return self.assemble(prompt_ids, prompt_mask, completion_ids, group_size, params, old_logp=old_logp)

    def _sample_with_ends(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        group_size: int,
        params: SamplingParams,
        engine_logprobs: bool,
    ) -> Rollout:
        """The rollout of an engine that says where each completion ends (stop strings)."""
        if not hasattr(self.generator, "generate_with_ends"):
            raise ValueError(
                f"stop strings need an engine that reports where they end completions "
                f"(generate_with_ends); {type(self.generator).__name__} does not"
            )
        out = self.generator.generate_with_ends(
            model, prompt_ids, prompt_mask, group_size, params, logprobs=engine_logprobs
        )
        return self.assemble(
            prompt_ids, prompt_mask, out.ids, group_size, params, old_logp=out.logp, ends=out.ends
        )

    def encode(
        self, prompts: list[Prompt], device: torch.device, tools: list[dict[str, Any]] | None = None
    ) -> tuple[Tensor, Tensor]:
        """The prompts as left-padded ``(ids, mask)`` on ``device``, per the prompt settings (the
        chat template given the tools' schemas ``tools``, where there are any)."""
        s = self.prompts
        prompt_ids, prompt_mask = encode_prompts(
            self.tokenizer,
            prompts,
            use_chat_template=s.use_chat_template,
            system_prompt=s.system_prompt,
            max_prompt_length=s.max_prompt_length,
            truncation=s.truncation,
            tools=tools,
        )
        return prompt_ids.to(device), prompt_mask.to(device)

    def assemble(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        completion_ids: Tensor,
        group_size: int,
        params: SamplingParams,
        *,
        old_logp: Tensor | None = None,
        behav_logp: Tensor | None = None,
        ends: Tensor | None = None,
    ) -> Rollout:
        """The :class:`Rollout` of sampled ``completion_ids``: masked at the first EOS, decoded.

        ``ends`` (P*G,): each row's length as the engine reports it (``Completions.ends``), which
        stop strings (``params.stop``) need: a row stopped at one is padded after it, often with
        the EOS. The mask then covers each row's first ``ends`` tokens, a row whose text holds a
        stop string is not truncated, and its text is cut right after the first one.
        """
        if ends is None and params.stop:
            raise ValueError("stop strings need the engine's completion ends: pass ends=Completions.ends")
        if ends is None:
            mask = completion_mask(completion_ids, self.eos_ids)
            truncated = truncated_rows(completion_ids, self.eos_ids, params.max_new_tokens)
        else:
            mask = mask_of_ends(ends.to(completion_ids.device), completion_ids.shape[1])
            is_eos = torch.isin(completion_ids, torch.tensor(self.eos_ids, device=completion_ids.device))
            truncated = (mask.sum(dim=1) >= params.max_new_tokens) & ~(is_eos & mask.bool()).any(dim=1)
        texts = decode_completions(self.tokenizer, completion_ids, mask)
        if params.stop:
            cut = [cut_at_stop(text, params.stop) for text in texts]
            texts = [text if c is None else c for text, c in zip(texts, cut)]
            stopped = torch.tensor([c is not None for c in cut], device=truncated.device)
            truncated = truncated & ~stopped
        return Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids,
            completion_mask=mask,
            group_size=group_size,
            completions=texts,
            old_logp=old_logp,
            truncated=truncated,
            behav_logp=behav_logp,
        )


def prompt_settings(model: PreTrainedModel, hp: Any, use_chat_template: bool) -> PromptSettings:
    """How the module's prompts are encoded for ``model``, per its hyperparameters ``hp``."""
    longest = max_prompt_length(model, hp.max_prompt_length, hp.max_new_tokens)
    return PromptSettings(use_chat_template, hp.system_prompt, longest, hp.prompt_truncation)


def max_prompt_length(model: PreTrainedModel, setting: int | None, max_new_tokens: int) -> int | None:
    """``max_prompt_length``, or where unset the model's context less ``max_new_tokens``: a prompt
    of millions of characters is cut (with a warning), not tokenised into a hang."""
    if setting is not None:
        return setting
    context = getattr(model.config, "max_position_embeddings", None)
    return None if context is None else max(context - max_new_tokens, 1)
