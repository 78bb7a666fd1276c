"""An LLM as a judge: :class:`JudgeReward` asks a model to rate each completion and reads a
number or a yes/no from its reply (rewards/judge_replies.py reads it).

The judge is a local HF causal LM (a folder or any model spec, run like RewardModel: batched, no
grad, eval mode, on the policy's device) or an OpenAI-compatible chat-completions endpoint. Each
completion is written into ``template``; the text is the judge's user message (through the local
model's chat template when its tokenizer has one), its greedy reply is read by ``parse``: by
default :func:`read_score`, which reads a yes/no or the score the judge gives ("7", "Score: 7/10",
"I give it 3", "8.5 out of 10"), never the numbers of a scale it names ("on a scale of 0 to 10"),
in the units of the scale the template names ("from 0 (useless) to 10 (perfect)": "4/5" is 8.0).
A reply ``parse`` cannot read (no score in it, or one outside the template's scale) is no score:
the reward reports it as unscored (rewards/batch_scoring.py), that sample's error, and
the module's rule for reward errors decides: ``raise`` names the sample and the reply, ``zero`` scores it 0
and counts it in ``reward_errors``. A checkpoint stores the judge's spec and, for a local folder,
its fingerprints as a reward model's (rewards/reward_model.py): a resume refuses other weights,
config, tokenizer or chat template, and a changed template or parser (rewards/resume_changes.py).
"""

from __future__ import annotations

import asyncio
import functools
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import torch
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.models.loading import ensure_pad_token, load_model
from forge_lightning.rewards.batch_scoring import UNSCORED
from forge_lightning.rewards.calls import BaseReward, RewardOutput, reward_name
from forge_lightning.rewards.http import (
    RewardServerError,
    auth_headers,
    check_retry_settings,
    checked_url,
    post_json,
    run_coroutine,
)
from forge_lightning.rewards.judge_replies import read_score, template_scale
from forge_lightning.rewards.reward_model import PolicyContext, formatting_fingerprints
from forge_lightning.rollout.engines.base import GenerationRequest, SamplingParams
from forge_lightning.rollout.engines.hf import HFGenerate, eos_token_ids
from forge_lightning.rollout.engines.legacy import as_engine
from forge_lightning.rollout.sampler import decode_completions, prompt_text
from forge_lightning.rollout.types import completion_mask, left_pad
from forge_lightning.run.fileio import folder_fingerprint

DEFAULT_TEMPLATE = (
    "Rate the response to the question from 0 (useless) to 10 (perfect). Reply with the number "
    "only.\n\nQuestion: {prompt}\n\nResponse: {completion}"
)


class JudgeReward(BaseReward):
    """Scores each completion by an LLM judge's reply (the module docstring says how).

    Args:
        model: the local judge, a causal LM: a spec (a ``save_pretrained`` folder, a hub id,
            anything ``model.model`` takes) or a built ``PreTrainedModel`` (with ``tokenizer``).
            With ``url``: the name of the model the endpoint serves (its requests' ``model``
            field); None sends none (a server with one model).
        url: an OpenAI-compatible endpoint instead of a local model: its base URL
            (``http://host:8000/v1``) or its ``.../chat/completions`` URL.
        template: the judge's message: ``{prompt}`` (the prompt's text: a conversation's last user
            message) and ``{completion}`` (required) are filled in, and any other ``{name}`` from
            the batch's field of that name (e.g. ``{references}``), which the run then must give.
        parse: reads a reply as a score: a function ``str -> float | None`` (None, or a
            ValueError: it cannot), e.g. by import path in a config; :func:`read_score` reads a
            yes/no or the score given, in the units of the template's scale (where it names one:
            ``from 0 to 10``, ``on a scale of 1 to 5``), and finds none outside that scale.
        tokenizer: required with a built model; loaded with a spec.
        batch_size: replies generated per forward pass (local), or requests in flight at once (url).
        max_new_tokens: the longest reply, in tokens.
        dtype: the local judge's weights' dtype (``float32``, ``bfloat16``, ...).
        device: where the local judge runs; None: the policy's device, from fit (or validate) start.
        timeout: seconds one request to ``url`` may take.
        retries: how many times a request that failed for the server's sake is tried again.
        backoff: seconds before the first retry, doubling for each later one.
        api_key_env: an environment variable holding the endpoint's key (sent as a Bearer token).
    """

    #: Arguments a resumed run may change (rewards/resume_changes.py): where the judge runs and how fast
    #: it is asked; the judge, its template and its parser may not.
    changeable_on_resume: ClassVar[tuple[str, ...]] = (
        "url", "batch_size", "device", "timeout", "retries", "backoff", "api_key_env",
    )  # fmt: skip

    def __init__(
        self,
        model: str | PreTrainedModel | None = None,
        url: str | None = None,
        template: str = DEFAULT_TEMPLATE,
        parse: Callable[[str], float | None] = read_score,
        tokenizer: PreTrainedTokenizerBase | None = None,
        batch_size: int = 8,
        max_new_tokens: int = 16,
        dtype: str = "float32",
        device: str | None = None,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 0.5,
        api_key_env: str | None = None,
    ) -> None:
        if batch_size < 1 or max_new_tokens < 1:
            raise ValueError(
                "JudgeReward needs batch_size >= 1 and max_new_tokens >= 1, got "
                f"{batch_size=}, {max_new_tokens=}"
            )
        if not callable(parse):
            raise TypeError(f"JudgeReward parse must be a function str -> float | None, got {parse!r}")
        check_retry_settings("JudgeReward", timeout, retries, backoff)
        self.model, self.url, self.tokenizer = model, url, tokenizer  # as given: what a checkpoint stores
        self.template, self.parse, self.max_new_tokens, self.dtype = template, parse, max_new_tokens, dtype
        self.batch_size, self.device = batch_size, device
        self.timeout, self.retries, self.backoff, self.api_key_env = timeout, retries, backoff, api_key_env
        self.needs = tuple(name for name in template_fields(template) if name not in ("prompt", "completion"))
        # The default reader puts a score in the template's units ("4/5" asked "from 0 to 10" is 8).
        scale = template_scale(template)
        self._reader = functools.partial(read_score, scale=scale) if parse is read_score else parse
        # A local judge's folder and its fingerprints, which checkpoints record as a reward
        # model's (reward_model.reward_model_fingerprints): a resume refuses a changed judge.
        self.folder = Path(model) if url is None and isinstance(model, str) and Path(model).is_dir() else None
        self.fingerprint = folder_fingerprint(self.folder) if self.folder is not None else None
        self.file_fingerprints: dict[str, str] = {}
        if url is not None:
            if model is not None and not isinstance(model, str):
                raise ValueError("JudgeReward: with url, model is the served model's name (a string) or None")
            self.endpoint = _chat_url(checked_url(url, "JudgeReward"))
            self.generator: PreTrainedModel | None = None
            return
        if model is None:
            raise ValueError(
                "JudgeReward needs a judge: model= (a causal LM's folder, spec or built model) or url= "
                "(an OpenAI-compatible endpoint)"
            )
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"JudgeReward dtype must name a torch dtype (float32, bfloat16), got {dtype!r}")
        self.generator, self._tokenizer = _causal_lm(model, tokenizer, getattr(torch, dtype))
        if self.folder is not None:
            self.file_fingerprints = formatting_fingerprints(self.folder, self._tokenizer)
        # What samples the replies: HF generate (a test or a user may set another engine with the
        # same generate signature, as the module's).
        self._eos = eos_token_ids(self._tokenizer, self.generator)
        self.engine = HFGenerate(self._tokenizer.pad_token_id, self._eos, self._tokenizer)
        if device is not None:
            self.generator.to(device)

    def use_policy_context(self, context: PolicyContext) -> None:
        """Move the local judge to the policy's device unless ``device`` was set."""
        if self.generator is not None and self.device is None:
            self.generator.to(context.device)

    def __call__(self, prompts: list[Any], responses: list[str], **kwargs: Any) -> RewardOutput:
        texts = [self.render(i, prompts, responses, kwargs) for i in range(len(responses))]
        replies = self._endpoint_replies(texts) if self.generator is None else self._local_replies(texts)
        scores, unscored = [], {}
        for i, reply in enumerate(replies):
            value = self._read(reply)
            if value is None:
                unscored[i] = (
                    f"its judge replied {reply!r}, which {reward_name(self.parse)} reads as no score"
                )
            scores.append(0.0 if value is None else value)
        return RewardOutput(scores=scores, metadata={"replies": replies, UNSCORED: unscored})

    def render(self, index: int, prompts: list[Any], responses: list[str], kwargs: dict[str, Any]) -> str:
        """The judge's message for completion ``index``: the template filled in (the completion's
        text is inserted as it is, never read as a template)."""
        values = {"prompt": prompt_text(prompts[index]), "completion": responses[index]}
        for name in self.needs:
            column = kwargs.get(name)
            if not isinstance(column, (list, tuple)) or len(column) != len(responses):
                raise ValueError(
                    f"JudgeReward's template names {{{name}}}, so the reward needs {name} as a list "
                    f"with one value per completion; got {type(column).__name__}"
                )
            values[name] = column[index]
        return self.template.format_map(values)

    def _read(self, reply: str) -> float | None:
        try:
            value = self._reader(reply)
        except ValueError:
            return None
        return None if value is None else float(value)

    def _local_replies(self, texts: list[str]) -> list[str]:
        tok, model = self._tokenizer, self.generator
        assert model is not None
        device = next(model.parameters()).device
        params = SamplingParams(self.max_new_tokens, greedy=True)
        replies: list[str] = []
        for start in range(0, len(texts), self.batch_size):
            rows = [self._encode(text) for text in texts[start : start + self.batch_size]]
            ids, mask = (t.to(device) for t in left_pad(rows, tok.pad_token_id))
            request = GenerationRequest(ids, mask, 1, params)
            # In its own dtype: a mixed-precision fit's autocast is off here (the engine's no_grad is on).
            with torch.autocast(device.type, enabled=False):
                out = as_engine(self.engine).generate(model, request).ids  # (B, Lr)
            replies += decode_completions(tok, out, completion_mask(out, self._eos))
        return replies

    def _encode(self, text: str) -> list[int]:
        tok = self._tokenizer
        if getattr(tok, "chat_template", None):
            messages = [{"role": "user", "content": text}]
            return list(
                tok.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        return tok(text)["input_ids"]

    def _endpoint_replies(self, texts: list[str]) -> list[str]:
        headers = auth_headers(self.api_key_env, "JudgeReward")

        async def ask_all() -> list[str]:
            gate = asyncio.Semaphore(self.batch_size)
            async with aiohttp.ClientSession() as session:

                async def ask(text: str) -> str:
                    request = {
                        "messages": [{"role": "user", "content": text}],
                        "max_tokens": self.max_new_tokens,
                        "temperature": 0.0,
                        **({"model": self.model} if self.model is not None else {}),
                    }
                    async with gate:
                        answer = await post_json(
                            session, self.endpoint, request, timeout=self.timeout, retries=self.retries,
                            backoff=self.backoff, headers=headers,
                        )  # fmt: skip
                    return _reply_text(self.endpoint, answer)

                return list(await asyncio.gather(*(ask(text) for text in texts)))

        return run_coroutine(ask_all)


def template_fields(template: str) -> list[str]:
    """The names ``template`` fills in; ValueError naming the template setting when it is not a
    ``str.format`` template of plain ``{name}`` fields with a ``{completion}`` among them."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except (ValueError, TypeError) as err:
        raise ValueError(f"JudgeReward template is not a format string ({err}): {template!r}") from None
    bad = [name for name in names if not name.isidentifier()]
    if bad or "completion" not in names:
        raise ValueError(
            "JudgeReward template fills in plain {name} fields and must name {completion}; got "
            f"{template!r}"
            + (f" (fields {bad} are not names; write a literal brace as {{{{ or }}}})" if bad else "")
        )
    return list(dict.fromkeys(names))


def _chat_url(url: str) -> str:
    """The chat-completions URL of an endpoint given by its base URL or by that URL itself."""
    url = url.rstrip("/")
    return url if url.endswith("/chat/completions") else f"{url}/chat/completions"


def _reply_text(url: str, answer: Any) -> str:
    """The first choice's message text of a chat-completions answer."""
    try:
        content = answer["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        content = None
    if not isinstance(content, str):
        raise RewardServerError(
            f"POST {url} answered {str(answer)[:200]!r}, not a chat completion "
            '({"choices": [{"message": {"content": "..."}}]})'
        )
    return content


def _causal_lm(
    model: str | PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The judge (frozen, eval mode, in ``dtype``) and its tokenizer, with a pad token."""
    if isinstance(model, str):
        model, tokenizer = load_model(model, dtype)
    elif tokenizer is None:
        raise ValueError("JudgeReward: a built model needs its tokenizer= too")
    else:
        model = model.to(dtype)
    model.eval().requires_grad_(False)
    return model, ensure_pad_token(tokenizer)
