"""Agent rollouts over the real openai client: a ChatML tokenizer, generation by script behind an
agent endpoint, and an agent runner on a tiny model."""

from __future__ import annotations

import platform
import string

import openai
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from forge_lightning.rollout.agents.endpoint import AgentEndpoint
from forge_lightning.rollout.agents.runner import AgentRunner
from forge_lightning.rollout.engines.hf import HFGenerate
from forge_lightning.rollout.sampler import PromptFormat, RolloutSampler
from helpers.models import make_model

# The openai client reads the processor's name once, by running uname -p: read here, at import,
# before any test (a unit test may start no process).
platform.processor()


SPECIAL = ["<pad>", "<|im_end|>", "<|im_start|>", "<unk>"]

# ChatML, the tools' names in a system block of their own.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


USER = {"role": "user", "content": "hi"}


def chat_tokenizer(template: str = TEMPLATE) -> PreTrainedTokenizerFast:
    """One token per printable character and ChatML's two control tokens; the EOS ends a turn."""
    chars = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL + chars)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = template
    return tok


class Script:
    """Generation by script: the i-th request's completion is ``replies[i]`` (sampled as plain
    characters, then the EOS; cut at the request's max new tokens, the EOS first); it records
    every prompt it was given."""

    def __init__(self, tok, replies: list[str]) -> None:
        self.tok, self.replies, self.prompts = tok, list(replies), []

    def __call__(self, batch):
        out = []
        for pending in batch:
            self.prompts.append(pending.prompt_ids)
            text = self.replies.pop(0)
            ids = self.tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            sampled = [*ids, self.tok.eos_token_id][: pending.max_new_tokens]
            out.append((sampled, sampled[-1] == self.tok.eos_token_id))
        return out


def serve(tok, replies, agent, budget=400):
    """Run ``agent(client)`` against an endpoint serving ``replies``; its result, the episode's
    log and the prompts sampled."""
    script = Script(tok, replies)
    with AgentEndpoint(tok) as endpoint:
        log = endpoint.open("e", budget)

        async def run():
            client = openai.AsyncOpenAI(
                base_url=endpoint.base_url("e"), api_key=endpoint.api_key, max_retries=0
            )
            try:
                return await agent(client)
            finally:
                await client.close()

        result = endpoint.serve(endpoint.run(run()), script)
    return result, log, script.prompts


def runner(agent, scored_by_agent: bool = True) -> tuple[AgentRunner, object, object]:
    tok = chat_tokenizer()
    eos = [tok.eos_token_id]
    sampler = RolloutSampler(tok, HFGenerate(tok.pad_token_id, eos, tok), eos, PromptFormat(True))
    model = make_model(len(tok), eos_token_id=1, pad_token_id=0)
    return AgentRunner(sampler, agent, scored_by_agent), tok, model
