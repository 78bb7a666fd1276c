"""The rollout sampler: prompts in, G sampled completions per prompt out, as a
:class:`~forge_lightning.rollout.types.Rollout`."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.rollout.control_tokens import encode_marked
from forge_lightning.rollout.engines.base import GenerationBackend, GenerationRequest, SamplingParams
from forge_lightning.rollout.engines.legacy import as_engine
from forge_lightning.rollout.types import (
    Prompt,
    Rollout,
    completion_mask,
    cut_at_stop,
    left_pad,
    mask_of_ends,
    truncated_rows,
)


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    *,
    use_chat_template: bool,
    system_prompt: str | None = None,
    max_prompt_length: int | None = None,
    truncation: str = "left",
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[Tensor, Tensor]:
    """Tokenize prompts (through the chat template when asked) into left-padded ``(ids, mask)``.

    A prompt is a string (the user message) or a conversation, a list of ``{"role", "content"}``
    messages (TRL's conversational format), which goes through the template as it is; its own
    system message wins over ``system_prompt``. ``chat_template_kwargs``: more variables for the
    template.

    Prompts longer than ``max_prompt_length`` keep their last tokens (the question and the cue to
    answer sit at the end) with a warning, or raise when ``truncation="error"``.
    """
    if use_chat_template:
        texts = [
            tokenizer.apply_chat_template(
                prompt_messages(p, system_prompt),
                tools=tools,
                tokenize=False,
                add_generation_prompt=True,
                **(chat_template_kwargs or {}),
            )
            for p in prompts
        ]
        # A tool environment's reset text in a message is data: its control tokens come marked
        # (rollout/control_tokens.py) and are encoded as plain text; an unmarked text encodes as before.
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
class PromptFormat:
    """How prompts become tokens: see :func:`encode_prompts` (the module's prompt settings, with
    the chat template and the longest prompt resolved for its model and tokenizer)."""

    use_chat_template: bool
    system_prompt: str | None = None
    max_prompt_length: int | None = None
    truncation: Literal["left", "error"] = "left"
    chat_template_kwargs: Mapping[str, Any] | None = None


PromptSettings = PromptFormat  # its name before settings.groups.PromptSettings took it


class RolloutSampler:
    """Prompts in, a :class:`Rollout` out: encode, sample G completions each, mask and decode.

    Built once per fit from the tokenizer, the generation engine and its prompt format.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        generator: GenerationBackend,
        eos_ids: Sequence[int],
        prompts: PromptFormat,
    ) -> None:
        self.tokenizer = tokenizer
        self.generator = as_engine(generator)  # an engine of the old generate: wrapped, with a warning
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
        if params.stop and not self.generator.capabilities.stop_strings:
            raise ValueError(
                f"stop strings need an engine that reports where they end completions (its "
                f"capabilities' stop_strings); {type(self.generator).__name__} does not"
            )
        request = GenerationRequest(prompt_ids, prompt_mask, group_size, params, logprobs=engine_logprobs)
        out = self.generator.generate(model, request)
        # Without stop strings every row ends at its first EOS, read from the ids as for any engine.
        ends = out.ends if params.stop else None
        return self.assemble(
            prompt_ids, prompt_mask, out.ids, group_size, params, old_logp=out.logp, ends=ends
        )

    def encode(
        self, prompts: list[Prompt], device: torch.device, tools: list[dict[str, Any]] | None = None
    ) -> tuple[Tensor, Tensor]:
        """The prompts as left-padded ``(ids, mask)`` on ``device``, per the prompt format (the
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
            chat_template_kwargs=s.chat_template_kwargs,
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


def max_prompt_length(model: PreTrainedModel, setting: int | None, max_new_tokens: int) -> int | None:
    """``max_prompt_length``, or where unset the model's context less ``max_new_tokens``: a prompt
    of millions of characters is cut (with a warning), not tokenised into a hang."""
    if setting is not None:
        return setting
    context = getattr(model.config, "max_position_embeddings", None)
    return None if context is None else max(context - max_new_tokens, 1)
