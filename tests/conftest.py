"""Shared fixtures: a tiny Llama and a character tokenizer built in the test, no network; the
helpers they are built from live in tests/helpers/."""

from __future__ import annotations

import os

# No test may reach the network: the hub client fails at once instead of retrying for a minute.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# README's test command runs the suite as two pytest-xdist workers side by side (pytest -n 2):
# one torch thread each, which the processes a test starts inherit, as two processes on two cores should.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import functools  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
from multiprocessing.process import BaseProcess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import rewards  # noqa: E402
from helpers.engines import CalculatorCalls, FixedCompletions  # noqa: E402
from helpers.gradients import exact_settings, gradient_spy, other_reference  # noqa: E402
from helpers.models import make_model, make_tokenizer  # noqa: E402
from helpers.sandbox import skip_unless_sandbox_isolates  # noqa: E402
from helpers.server import Handler, LocalServer  # noqa: E402
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


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


@pytest.fixture
def isolating_machine(request):
    """A test that starts sandboxed workers (marked integration) runs where the machine can isolate
    them (sandbox/isolation.py's probe: unshare, Landlock, a pids bound); elsewhere it is skipped with
    the probe's reason, as the GPU tests are without a GPU. The refusal itself is tested on every machine
    (run/test_sandbox.py). A module asks for it with ``pytest.mark.usefixtures``."""
    if "integration" in request.keywords:
        skip_unless_sandbox_isolates()


# -- shared factories, as fixtures: a test asks for the factory and calls it with its settings --


@pytest.fixture
def count_a():
    return rewards.count_a


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
            reward=rewards.count_a,
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
            grpo.engine = CalculatorCalls(grpo.tokenizer)
        elif fixed:
            grpo.engine = FixedCompletions(len(grpo.tokenizer), grpo.tokenizer.eos_token_id)
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
