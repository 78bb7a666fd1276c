"""Fake generation engines: completions written by rule or by script instead of sampled, so a
test knows what each rollout holds."""

from __future__ import annotations

import torch

from forge_lightning.rollout.engines.base import Completions, EngineCapabilities, GenerationRequest


class FixedCompletions:
    """A generation engine whose completions depend on nothing but their prompt: however prompts
    are split into batches, accumulation batches or ranks, each gets the same G completions
    (of lengths 1 to ``max_new_tokens``, ending with EOS)."""

    def __init__(self, vocab_size: int, eos: int) -> None:
        self.vocab_size, self.eos = vocab_size, eos

    capabilities = EngineCapabilities()

    def generate(self, model, request: GenerationRequest) -> Completions:
        rows = []
        for ids, mask in zip(request.prompt_ids.tolist(), request.prompt_mask.tolist()):
            seed = sum(i * m for i, m in zip(ids, mask))
            for j in range(request.group_size):
                length = 1 + (seed + 3 * j) % request.params.max_new_tokens
                body = [4 + (seed * 7 + j * 5 + k * 3) % (self.vocab_size - 4) for k in range(length - 1)]
                rows.append([*body, self.eos])
        width = max(len(r) for r in rows)
        padded = [r + [self.eos] * (width - len(r)) for r in rows]
        return Completions(torch.tensor(padded, device=request.prompt_ids.device))

    def sync_weights(self, model) -> None:
        pass


class ScriptedAnswers:
    """An engine answering each prompt from ``script`` (prompt text -> its answers; a call takes
    the first ``group_size``), recording the sampling settings it was asked for."""

    def __init__(self, tokenizer, script: dict[str, list[str]]) -> None:
        self.tok, self.script, self.params = tokenizer, script, []

    capabilities = EngineCapabilities()

    def generate(self, model, request: GenerationRequest) -> Completions:
        self.params.append(request.params)
        rows = []
        for ids, mask in zip(request.prompt_ids.tolist(), request.prompt_mask.tolist()):
            prompt = self.tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True)
            for text in self.script[prompt][: request.group_size]:
                rows.append([*self.tok(text, add_special_tokens=False)["input_ids"], self.tok.eos_token_id])
        return Completions(torch.tensor(rows, device=request.prompt_ids.device))

    def sync_weights(self, model) -> None:
        pass


class CalculatorCalls:
    """An engine without stopping criteria whose completions call the inline calculator
    (annotation style) depending on their prompt alone: a prompt with a space makes no call; any
    other makes ``j`` calls in completion ``j`` of its group (one per round, each ``<<j+k=``),
    then writes ``ok`` and ``j`` characters. The sampler cuts each round at its call, so ranks and
    batches holding different prompts take different numbers of rounds."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer

    def continuation(self, prompt: str, done: str, j: int) -> str:
        calls = done.count(">>")
        if " " in prompt or calls >= j:
            return " ok" + "ab"[j % 2] * j
        return f"<<{j}+{calls}="

    capabilities = EngineCapabilities()

    def generate(self, model, request: GenerationRequest) -> Completions:
        rows = []
        for ids, mask in zip(request.prompt_ids.tolist(), request.prompt_mask.tolist()):
            text = self.tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True)
            prompt, _, done = text.partition("#")
            for j in range(request.group_size):
                # Round 1 holds the bare prompt (the row's index in its group picks its script);
                # later rounds carry it after the "#" the first round wrote.
                index = j if not done else int(done[0])
                head = f"#{index}" if not done else ""
                new = self.tok(head + self.continuation(prompt, done, index), add_special_tokens=False)
                rows.append([*new["input_ids"], self.tok.eos_token_id][: request.params.max_new_tokens])
        width = max(len(r) for r in rows)
        return Completions(
            torch.tensor(
                [r + [self.tok.eos_token_id] * (width - len(r)) for r in rows],
                device=request.prompt_ids.device,
            )
        )

    def sync_weights(self, model) -> None:
        pass


class TurnEngine:
    """An engine that writes the policy's ``k``-th turn after ``k`` tool messages (``marker``
    begins one in the template's text), then EOS; it knows no stopping criteria, so the sampler
    cuts a row at its call itself."""

    def __init__(self, tok, turns, marker: str = "<|im_start|>tool") -> None:
        self.tok, self.turns, self.inputs, self.marker = tok, turns, [], marker

    capabilities = EngineCapabilities()

    def generate(self, model, request: GenerationRequest) -> Completions:
        rows = []
        for ids, mask in zip(request.prompt_ids.tolist(), request.prompt_mask.tolist()):
            text = self.tok.decode([i for i, m in zip(ids, mask) if m])
            self.inputs.append(text)
            turn = self.turns[min(text.count(self.marker), len(self.turns) - 1)]
            # A model writes characters: special tokens in a turn's text are written as text.
            new = (
                turn
                if isinstance(turn, list)
                else self.tok(turn, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            )
            rows += [[*new, self.tok.eos_token_id][: request.params.max_new_tokens]] * request.group_size
        width = max(len(r) for r in rows)
        return Completions(torch.tensor([r + [self.tok.pad_token_id] * (width - len(r)) for r in rows]))

    def sync_weights(self, model) -> None:
        pass
