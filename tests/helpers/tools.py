"""Tool-using rollouts on tiny models: a ChatML tokenizer, function tools and environments, the
samplers around them, and a protocol that calls at given lengths."""

from __future__ import annotations

import json
import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, StoppingCriteria

from forge_lightning.rollout.engines.base import SamplingParams
from forge_lightning.rollout.engines.hf import HFGenerate
from forge_lightning.rollout.sampler import PromptFormat, RolloutSampler
from forge_lightning.rollout.tool_sampler import ToolRolloutSampler
from forge_lightning.rollout.tools import FunctionTools, InlineCalculator
from forge_lightning.rollout.tools.protocol import Answer
from helpers.models import make_model

GREEDY = SamplingParams(max_new_tokens=400, greedy=True)

SPECIAL = ["<pad>", "<|im_end|>", "<|im_start|>", "<unk>"]

CHARS = sorted(set(string.printable) - set("\t\r\x0b\x0c"))

# ChatML with the tools' names in a system block of their own.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# The same without the tools: a template that ignores them.
PLAIN_TEMPLATE = TOOL_TEMPLATE[TOOL_TEMPLATE.index("{%- for") :]


def chat_tokenizer(template: str = TOOL_TEMPLATE, name: str = "tiny-chatml") -> PreTrainedTokenizerFast:
    """One token per printable character, ChatML's two special tokens; the EOS ends a turn."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<|im_start|>",
    )
    tok.chat_template, tok.name_or_path = template, name
    return tok


SEEN: list[dict] = []


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    SEEN.append({"a": a, "b": b})
    return a + b


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def sampler(
    tok, tools, generator=None, max_tool_calls=4, timeout=10.0, env=None, template_kwargs=None, **settings
):
    eos = [tok.eos_token_id]
    generator = generator or HFGenerate(tok.pad_token_id, eos)
    base = RolloutSampler(tok, generator, eos, PromptFormat(True, chat_template_kwargs=template_kwargs))
    protocol = FunctionTools(
        tok, tools, environment_factory=env, timeout=timeout, chat_template_kwargs=template_kwargs, **settings
    )
    return ToolRolloutSampler(base, protocol, max_tool_calls)


def tiny(tok):
    return make_model(len(tok), bos_token_id=2, eos_token_id=1, pad_token_id=0)


def split(tok, rollout, row):
    """Row ``row``'s text the policy sampled and the text the tools wrote, each with special tokens."""
    ids, real, sampled = (
        t[row].tolist() for t in (rollout.completion_ids, rollout.completion_mask, rollout.model_mask)
    )
    model = [i for i, r, s in zip(ids, real, sampled) if r and s]
    tool = [i for i, r, s in zip(ids, real, sampled) if r and not s]
    return tok.decode(model), tok.decode(tool)


class Counter:
    """An environment whose state is a counter; its target comes from the row."""

    made: list[Counter] = []

    def __init__(self) -> None:
        self.count, self.target = 0, None
        Counter.made.append(self)

    def reset(self, reference: str) -> str:
        self.target = int(reference)
        return f"Reach {reference}."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much.
        """
        self.count += by
        return self.count

    def reward(self) -> float:
        return float(self.count == self.target)


class TrlCounter:
    """An environment as TRL writes one: its reward hook is ``get_reward``."""

    def __init__(self) -> None:
        self.count, self.target = 0, None

    def reset(self, reference: str) -> None:
        self.target = int(reference)

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much.
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count == self.target)


def make_counter() -> TrlCounter:
    return TrlCounter()


def tool_sampler(tokenizer, generator=None, style="annotation", max_tool_calls=4) -> ToolRolloutSampler:
    eos = [tokenizer.eos_token_id]
    generator = generator or HFGenerate(tokenizer.pad_token_id, eos)
    base = RolloutSampler(tokenizer, generator, eos, PromptFormat(use_chat_template=False))
    return ToolRolloutSampler(base, InlineCalculator(style), max_tool_calls)


class CallsAtLengths:
    """A tool protocol for checking the rounds' bookkeeping on a random model: a completion "calls"
    whenever its length reaches one of ``lengths``, answered with 1 to 5 tokens (by the
    completion's index), so that rows reach their next call at different times and some wait. Which tokens
    are sampled does not matter, only how many."""

    names, calls_before_eos = ["at"], False

    def __init__(self, tokenizer, lengths: set[int]) -> None:
        self.lengths = lengths
        self.answers = [tokenizer(a)["input_ids"] for a in ("x", "xy", "xyz", "wxyz", "vwxyz")]

    def begin(self, sampler, prompts, rows, group_size, device):
        ids, mask = sampler.encode(prompts, device)
        return ids, mask, list(range(len(prompts) * group_size))  # context: the completion's index

    def may_end_a_call(self, token):
        return True

    def call_at(self, episode, completion):
        return "at" if len(completion) in self.lengths else None

    def stop(self, start, prior, enabled, segments, eos_ids):
        lengths = self.lengths

        class AtLength(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                written = [p + input_ids.shape[1] - start for p in prior]
                return torch.tensor([on and n in lengths for on, n in zip(enabled, written)])

        return AtLength()

    def answer(self, calls):
        entry = {"name": "at", "arguments": {}, "result": "", "ok": True}
        return [
            Answer(ids=list(self.answers[episode.context % 5]), ok=True, entry=entry) for episode, _ in calls
        ]
