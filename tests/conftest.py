"""Shared fixtures: a tiny Llama and a character tokenizer built in the test, no network."""

from __future__ import annotations

import os

# No test may reach the network: the hub client fails at once instead of retrying for a minute.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import asyncio  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import string  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from multiprocessing.process import BaseProcess  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from aiohttp import web  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

# A 2-layer Llama seeded with ``seed``; ``overrides`` replace any of its LlamaConfig fields.
from forge_lightning.testing import tiny_model as make_model  # noqa: E402

GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHARS = list(string.ascii_letters + string.digits + " .,:;?!+-*/=()$%#\n'\"<>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


# -- test tiers: `pytest -m unit` is the fast loop -----------------------------------------------
# A test is `unit` unless it is marked `integration` (it builds a Lightning Trainer or starts a
# process) or `slow` (it loads the embedded 135M model). What a test does is watched over its whole
# run, the setup of the module-wide fixtures it is the first to use included: a unit test that
# does one of those fails and says which. FORGE_RECORD_TIERS=<file> records what each test does
# instead, one JSON line each.


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(name) for name in ("integration", "slow")):
            item.add_marker(pytest.mark.unit)


def _watch(done: set[str]) -> list[tuple[object, str, object]]:
    """Wrap what a unit test may not do so that each call adds its name to ``done``; the undo list."""
    import lightning.pytorch as pl

    from forge_lightning.models import loading

    def noting(what: str, original):
        @functools.wraps(original)  # LightningCLI reads the Trainer's signature through it
        def run(*args, **kwargs):
            done.add(what)
            return original(*args, **kwargs)

        return run

    targets = [
        (pl.Trainer, "__init__", "builds a Trainer"),
        (subprocess.Popen, "__init__", "starts a process"),
        (BaseProcess, "start", "starts a process"),
        (loading, "embedded_gguf_path", "loads the 135M model"),
        (loading, "_embedded_cache", "loads the 135M model"),
    ]
    undo = []
    for owner, name, what in targets:
        original = owner.__dict__[name]
        setattr(owner, name, noting(what, original))
        undo.append((owner, name, original))
    return undo


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    item.stash[_DONE] = done = set()
    undo = _watch(done)
    try:
        yield
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)
        record = os.environ.get("FORGE_RECORD_TIERS")
        if record:
            with open(record, "a") as f:
                f.write(json.dumps({"test": item.nodeid, "does": sorted(done)}) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    done = item.stash.get(_DONE, set())
    if call.when == "call" and report.passed and done and item.get_closest_marker("unit"):
        if not os.environ.get("FORGE_RECORD_TIERS"):
            report.outcome = "failed"
            report.longrepr = f"a unit test {' and '.join(sorted(done))}: mark it integration (or slow)"


_DONE = pytest.StashKey[set]()


def make_tokenizer(chat_template: bool = False) -> PreTrainedTokenizerFast:
    """One token per character; pad is the EOS, as in SmolLM2."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def skip_unless_sandbox_isolates() -> None:
    """Skip the test, with the probe's reason, where the machine cannot isolate sandboxed workers
    (run/isolation.py's probe: unshare, Landlock, a pids bound), as the GPU tests are without a GPU."""
    from forge_lightning.run import isolation
    from forge_lightning.run.sandbox import SandboxUnavailable

    try:
        isolation.probe()
    except SandboxUnavailable as err:
        pytest.skip(f"this machine cannot isolate sandboxed workers: {err}")


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture
def tiny_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    return make_model(len(tokenizer))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model + tokenizer saved with save_pretrained: a local-folder model spec."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tok = make_tokenizer()
    make_model(len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def calculator_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model folder whose next token depends on the current one alone, most likely along
    ``3 + 4 =`` (the plain calculator's call; its answer `` 7`` then leads to EOS) from any other
    character: a bigram table in a Llama with its attention and MLP outputs zeroed. Sampled at
    temperature 1, about 99 in 100 tokens follow the table, so completions vary but most call."""
    folder = tmp_path_factory.mktemp("calculator-llama")
    tok = make_tokenizer()
    size = len(tok)
    model = make_model(size, hidden_size=128, intermediate_size=64, tie_word_embeddings=False)
    ids = {c: tok.convert_tokens_to_ids(c) for c in "3+4=7"}
    following = {ids["3"]: ids["+"], ids["+"]: ids["4"], ids["4"]: ids["="], ids["7"]: tok.eos_token_id}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(size, 128))
        head = torch.zeros(size, 128)
        for i in range(size):
            # The final RMSNorm scales a one-hot row to sqrt(128): a logit of 9 for the next token.
            head[following.get(i, ids["3"]), i] = 9.0 / 128**0.5
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture
def gsm8k_dir() -> Path:
    if not (GSM8K_DIR / "train.jsonl").is_file():
        pytest.skip(f"GSM8K files not found at {GSM8K_DIR}")
    return GSM8K_DIR


# -- shared factories, as fixtures: a test asks for the factory and calls it with its settings --


def _count_a(prompts: list[str], responses: list[str]) -> list[float]:
    """Fraction of 8 completion characters that are 'a': a task a random tiny model can learn."""
    return [sum(ch == "a" for ch in r) / 8 for r in responses]


@pytest.fixture
def count_a():
    return _count_a


@pytest.fixture
def loader():
    """``loader(records, batch_size=1)``: a DataLoader of prompt records, collated as the datamodule does."""
    from torch.utils.data import DataLoader

    from forge_lightning.data.datamodule import collate_records

    def make(records: list[dict], batch_size: int = 1) -> DataLoader:
        return DataLoader(records, batch_size=batch_size, collate_fn=collate_records)

    return make


@pytest.fixture
def trainer():
    """``trainer(root, **kwargs)``: a quiet CPU Trainer for one epoch, writing under ``root``."""
    import lightning.pytorch as pl

    def make(root: Path, **kwargs) -> pl.Trainer:
        defaults = dict(
            accelerator="cpu",
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        return pl.Trainer(**{**defaults, **kwargs})

    return make


@pytest.fixture
def module():
    """``module(**kwargs)``: a GRPOLightningModule on a fresh tiny Llama, rewarding 'a' characters."""
    from forge_lightning.module import GRPOLightningModule

    def make(**kwargs) -> GRPOLightningModule:
        tok = make_tokenizer()
        defaults = dict(
            model=make_model(len(tok)),
            tokenizer=tok,
            reward=_count_a,
            group_size=4,
            max_new_tokens=8,
            learning_rate=1e-3,
        )
        return GRPOLightningModule(**{**defaults, **kwargs})

    return make


@pytest.fixture
def tiny_overrides():
    """``tiny_overrides(model_dir, out)``: CLI flags that run a shipped config on a tiny model in ``out``."""

    def make(model_dir: Path, out: Path) -> list[str]:
        return [
            f"--model.model={model_dir}",
            "--model.group_size=4",
            "--model.max_new_tokens=6",
            "--trainer.accelerator=cpu",
            "--trainer.precision=32-true",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={out}",
        ]

    return make


def _varied(prompts: list[str], responses: list[str]) -> list[float]:
    return [float(sum(map(ord, r)) % 5) for r in responses]


class FixedCompletions:
    """A generation engine whose completions depend on nothing but their prompt: however prompts
    are split into batches, accumulation batches or ranks, each gets the same G completions
    (of lengths 1 to ``max_new_tokens``, ending with EOS)."""

    def __init__(self, vocab_size: int, eos: int) -> None:
        self.vocab_size, self.eos = vocab_size, eos

    def generate(self, model, prompt_ids, prompt_mask, group_size, params) -> torch.Tensor:
        rows = []
        for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist()):
            seed = sum(i * m for i, m in zip(ids, mask))
            for j in range(group_size):
                length = 1 + (seed + 3 * j) % params.max_new_tokens
                body = [4 + (seed * 7 + j * 5 + k * 3) % (self.vocab_size - 4) for k in range(length - 1)]
                rows.append([*body, self.eos])
        width = max(len(r) for r in rows)
        padded = [r + [self.eos] * (width - len(r)) for r in rows]
        return torch.tensor(padded, device=prompt_ids.device)

    def sync_weights(self, model) -> None:
        pass


class ScriptedAnswers:
    """An engine answering each prompt from ``script`` (prompt text -> its answers; a call takes
    the first ``group_size``), recording the sampling settings it was asked for."""

    def __init__(self, tokenizer, script: dict[str, list[str]]) -> None:
        self.tok, self.script, self.params = tokenizer, script, []

    def generate(self, model, prompt_ids, prompt_mask, group_size, params) -> torch.Tensor:
        self.params.append(params)
        rows = []
        for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist()):
            prompt = self.tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True)
            for text in self.script[prompt][:group_size]:
                rows.append([*self.tok(text, add_special_tokens=False)["input_ids"], self.tok.eos_token_id])
        return torch.tensor(rows, device=prompt_ids.device)

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

    def generate(self, model, prompt_ids, prompt_mask, group_size, params) -> torch.Tensor:
        rows = []
        for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist()):
            text = self.tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True)
            prompt, _, done = text.partition("#")
            for j in range(group_size):
                # Round 1 holds the bare prompt (the row's index in its group picks its script);
                # later rounds carry it after the "#" the first round wrote.
                index = j if not done else int(done[0])
                head = f"#{index}" if not done else ""
                new = self.tok(head + self.continuation(prompt, done, index), add_special_tokens=False)
                rows.append([*new["input_ids"], self.tok.eos_token_id][: params.max_new_tokens])
        width = max(len(r) for r in rows)
        return torch.tensor(
            [r + [self.tok.eos_token_id] * (width - len(r)) for r in rows], device=prompt_ids.device
        )

    def sync_weights(self, model) -> None:
        pass


def other_reference():
    from forge_lightning.callbacks import ReferenceModel

    class Other(ReferenceModel):
        def _build(self, trainer, policy):
            return make_model(policy.config.vocab_size, seed=5).to(policy.dtype).requires_grad_(False)

    return Other()


def exact_settings(**settings) -> dict:
    """The settings of the gradient-equivalence runs: a seeded tiny policy, fixed completions."""
    torch.manual_seed(1)
    tok = make_tokenizer()
    # float64, so that sums taken in another order agree to far below the tolerances checked
    defaults = dict(model=make_model(len(tok)).double(), tokenizer=tok, reward=_varied, max_new_tokens=6)
    defaults.update(kl_beta=0.05, max_grad_norm=None, gradient_accumulation_steps=1, group_size=4)
    return {**defaults, **settings}


def gradient_spy(grads: list):
    import lightning.pytorch as pl

    class Grads(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads.extend(p.grad.clone() for p in pl_module.model.parameters())

    return Grads()


@pytest.fixture
def step_gradients(tmp_path, module, trainer, loader):
    """``step_gradients(records=..., batch_size=2, fixed=False, **settings)``: one optimizer step
    of the tiny module (seeded, so every call samples the same completions; ``fixed`` makes them
    depend on the prompt alone, see FixedCompletions; ``fixed="calculator"``: CalculatorCalls);
    returns the step's ``train/loss`` and each
    parameter's gradient just before the optimizer applies it. The reference is another random
    model, so the KL term has a gradient from the first step."""
    import lightning.pytorch as pl

    calls = []

    def run(records=None, batch_size=2, fixed=False, **settings) -> tuple[float, list[torch.Tensor]]:
        pl.seed_everything(1)
        grpo = module(**exact_settings(**settings))
        if fixed == "calculator":
            grpo.generator = CalculatorCalls(grpo.tokenizer)
        elif fixed:
            grpo.generator = FixedCompletions(len(grpo.tokenizer), grpo.tokenizer.eos_token_id)
        grads: list[torch.Tensor] = []
        calls.append(len(calls))
        records = records or [{"prompt": "ab"}, {"prompt": "abc d"}]
        fit = trainer(
            tmp_path / f"step{len(calls)}", max_steps=1, callbacks=[other_reference(), gradient_spy(grads)]
        )
        fit.fit(grpo, loader(records, batch_size=batch_size))
        return grpo.last_step.metrics["train/loss"], grads

    return run


# -- a real local HTTP server (rewards scored over HTTP): aiohttp on 127.0.0.1, an ephemeral port,
# its event loop in a thread of the test

# A handler gets the request's JSON body and the number of the request (0 for the first) and
# returns the answer: a JSON-able value (HTTP 200), or a web.Response of its own.
Handler = Callable[[Any, int], Awaitable[Any]]


class LocalServer:
    """One aiohttp app answering POSTs to ``path`` with ``handler``; ``requests`` holds each
    request's JSON body and ``headers`` its headers, in order."""

    def __init__(self, handler: Handler, path: str) -> None:
        self.handler, self.requests, self.headers = handler, [], []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}{path}"
        app = web.Application()
        app.router.add_post(path, self._answer)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)  # a stalled handler is cut at stop
        self._run(self._start(sock))

    async def _start(self, sock: socket.socket) -> None:
        await self.runner.setup()
        await web.SockSite(self.runner, sock).start()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        answer = await self.handler(body, len(self.requests) - 1)
        return answer if isinstance(answer, web.StreamResponse) else web.Response(text=json.dumps(answer))

    def _run(self, coroutine: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=10)

    def stop(self) -> None:
        """Close the server (its port then refuses connections) and end its thread; twice is once."""
        if self.thread.is_alive():
            self._run(self.runner.cleanup())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            self.loop.close()


@pytest.fixture
def serve():
    """``serve(handler, path="/score")``: a started :class:`LocalServer`, stopped after the test."""
    servers: list[LocalServer] = []

    def start(handler: Handler, path: str = "/score") -> LocalServer:
        servers.append(LocalServer(handler, path))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def mixed_rollout(
    vocab_size: int, ends: list[int], prompt_lengths: list[int], group_size: int, seed: int = 0
):
    """A rollout of random tokens whose completion ``i`` ends with an EOS (id 1) at column
    ``ends[i] - 1`` (none where ``ends[i]`` is the width, ``max(ends)``): completions of mixed
    lengths, and left-padded prompts of ``prompt_lengths`` tokens."""
    from forge_lightning.rollout.types import Rollout, completion_mask

    generator = torch.Generator().manual_seed(seed)
    width, prompt_width = max(ends), max(prompt_lengths)
    completions = torch.randint(4, vocab_size, (len(ends), width), generator=generator)
    for row, end in enumerate(ends):
        if end < width:
            completions[row, end - 1] = 1
    prompt_mask = torch.tensor([[0] * (prompt_width - n) + [1] * n for n in prompt_lengths])
    prompt_ids = torch.randint(4, vocab_size, prompt_mask.shape, generator=generator) * prompt_mask
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completions,
        completion_mask=completion_mask(completions, [1]),
        group_size=group_size,
        completions=[""] * len(ends),
    )
