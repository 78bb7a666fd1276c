"""One engine call: every engine's ``generate(model, request)`` returns ``Completions``, what it
can give is its declared ``capabilities`` (never probed), engines import nothing of ``rollout/``
but its shared types, and an engine of the old five-argument ``generate`` still samples through
one adapter (rollout/engines/legacy.py), with a deprecation warning."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch
from helpers.import_graph import ROOT, import_graph
from helpers.models import make_model, make_tokenizer, scripted
from helpers.tools import GREEDY, tool_sampler

from forge_lightning.rollout.engines.base import (
    Completions,
    EngineCapabilities,
    GenerationRequest,
    SamplingParams,
)
from forge_lightning.rollout.engines.hf import HFGenerate
from forge_lightning.rollout.engines.legacy import LegacyEngine, as_engine
from forge_lightning.rollout.engines.quantized import QuantizedGenerate
from forge_lightning.rollout.engines.vllm import VLLMGenerate
from forge_lightning.rollout.sampler import PromptFormat, RolloutSampler
from forge_lightning.serving.client import RemoteEngine
from forge_lightning.testing import ScriptedEngine

# The names of the old variants of generate and of its stop argument: only the adapter reads them.
OLD_NAMES = {"generate_with_logprobs", "generate_with_ends", "generate_continuing", "stopping_criteria"}
ADAPTER = Path("rollout/engines/legacy.py")


def engine_probes(path: Path) -> list[str]:
    """``hasattr``/``getattr`` calls for a ``generate...`` attribute, ``inspect.signature`` of a
    ``generate``, and any use of an old variant's name (an attribute or a string), in a file: one
    line each, in order."""
    found: dict[int, str] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        probe = (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("generate")
        )
        signature = (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "signature"
            and node.args
            and isinstance(node.args[0], ast.Attribute)
            and node.args[0].attr == "generate"
        )
        named = (isinstance(node, ast.Attribute) and node.attr in OLD_NAMES) or (
            isinstance(node, ast.Constant) and node.value in OLD_NAMES
        )
        if (probe or signature or named) and node.lineno not in found:
            found[node.lineno] = f"{path.name}:{node.lineno}: {ast.unparse(node)}"
    return [found[line] for line in sorted(found)]


def test_no_package_file_probes_an_engine_for_a_generate_variant():
    probes = [
        probe
        for path in sorted(ROOT.rglob("*.py"))
        if path.relative_to(ROOT) != ADAPTER
        for probe in engine_probes(path)
    ]
    assert not probes, "engines probed instead of read from their capabilities:\n" + "\n".join(probes)


def test_the_probe_scan_finds_each_kind_of_probe(tmp_path):
    source = tmp_path / "probing.py"
    source.write_text(
        "import inspect\n"
        "a = hasattr(engine, 'generate_with_ends')\n"
        "b = 'stopping_criteria' in inspect.signature(engine.generate).parameters\n"
        "c = engine.generate_continuing(model)\n"
        "d = engine.generate(model, request)\n"  # the one call: not a probe
    )
    assert [line.split(":")[1] for line in engine_probes(source)] == ["2", "3", "4"]


def test_engines_import_nothing_of_rollout_but_their_shared_types():
    engines, allowed = "forge_lightning.rollout.engines", {"forge_lightning.rollout.types"}
    outside = sorted(
        f"{module} -> {target}"
        for module, imported in import_graph().items()
        if module.startswith(engines)
        for target in imported
        if target.startswith("forge_lightning.rollout")
        and not target.startswith(engines)
        and target not in allowed
    )
    assert not outside, "rollout/engines/ reaching into rollout/:\n" + "\n".join(outside)


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        (HFGenerate, EngineCapabilities(logprobs=True, stop_strings=True, stop_rule=True, continues=True)),
        (QuantizedGenerate, HFGenerate.capabilities),
        (VLLMGenerate, EngineCapabilities(logprobs=True, stop_strings=True)),
        (RemoteEngine, EngineCapabilities(logprobs=True, stop_strings=True)),
        (ScriptedEngine, EngineCapabilities()),
    ],
)
def test_every_engine_declares_its_capabilities(engine, expected):
    assert engine.capabilities == expected


def test_an_engine_that_declares_its_capabilities_is_used_as_it_is():
    tok = make_tokenizer()
    engine = HFGenerate(tok.pad_token_id, [tok.eos_token_id], tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert as_engine(engine) is engine
        assert RolloutSampler(tok, engine, [tok.eos_token_id], PromptFormat(False)).generator is engine


def test_a_request_for_what_an_engine_lacks_names_the_capability():
    tok = make_tokenizer()
    ids = torch.tensor([[5, 6]])
    engine = ScriptedEngine(tok, [[["hi"]]])
    with pytest.raises(ValueError, match="ScriptedEngine .* lack logprobs, stop_strings"):
        engine.generate(None, GenerationRequest(ids, ids, 1, SamplingParams(4, stop=("x",)), logprobs=True))


class OldHF:
    """An engine written to the old interface, every variant of it, each the HF engine's answer."""

    def __init__(self, tok) -> None:
        self.hf = HFGenerate(tok.pad_token_id, [tok.eos_token_id], tok)
        self.calls: list[str] = []

    def _ask(self, name, model, *args, **kwargs) -> Completions:
        self.calls.append(name)
        return self.hf.generate(model, GenerationRequest(*args, **kwargs))

    def generate(self, model, prompt_ids, prompt_mask, group_size, params, stopping_criteria=None):
        return self._ask(
            "generate", model, prompt_ids, prompt_mask, group_size, params, stop_rule=stopping_criteria or ()
        ).ids

    def generate_with_logprobs(self, model, prompt_ids, prompt_mask, group_size, params):
        out = self._ask(
            "generate_with_logprobs", model, prompt_ids, prompt_mask, group_size, params, logprobs=True
        )
        return out.ids, out.logp

    def generate_with_ends(self, model, prompt_ids, prompt_mask, group_size, params, logprobs=False):
        return self._ask(
            "generate_with_ends", model, prompt_ids, prompt_mask, group_size, params, logprobs=logprobs
        )

    def generate_continuing(
        self, model, ids, mask, group_size, params, stopping_criteria, cache=None, logprobs=False
    ):
        out = self._ask(
            "generate_continuing", model, ids, mask, group_size, params,
            logprobs=logprobs, stop_rule=stopping_criteria, continuing=True, cache=cache,
        )  # fmt: skip
        whole = torch.cat([ids.repeat_interleave(group_size if cache is None else 1, dim=0), out.ids], dim=1)
        return whole, out.cache, out.logp

    def sync_weights(self, model) -> None:
        self.calls.append("sync_weights")


class OldPlain:
    """An engine of the old five-argument ``generate`` and nothing else."""

    def generate(self, model, prompt_ids, prompt_mask, group_size, params):
        return torch.full((prompt_ids.shape[0] * group_size, 2), 7)

    def sync_weights(self, model) -> None:
        pass


def wrapped(engine) -> LegacyEngine:
    with pytest.warns(DeprecationWarning, match=r"OldHF|OldPlain.*deprecated.*GenerationRequest"):
        adapter = as_engine(engine)
    assert isinstance(adapter, LegacyEngine)
    return adapter


def test_an_old_engine_is_wrapped_with_a_warning_and_its_capabilities_are_its_methods():
    tok = make_tokenizer()
    assert wrapped(OldHF(tok)).capabilities == HFGenerate.capabilities
    assert wrapped(OldPlain()).capabilities == EngineCapabilities()


@pytest.mark.parametrize(
    ("params", "logprobs", "called"),
    [
        (SamplingParams(6, greedy=True), False, "generate"),
        (SamplingParams(6, greedy=True), True, "generate_with_logprobs"),
        (SamplingParams(6, greedy=True, stop=("+",)), True, "generate_with_ends"),
    ],
)
def test_an_old_engine_samples_the_rollout_the_new_one_does(params, logprobs, called):
    tok = make_tokenizer()
    model = scripted(tok, "xy3+4=7")
    old, eos, fmt = OldHF(tok), [tok.eos_token_id], PromptFormat(use_chat_template=False)
    with pytest.warns(DeprecationWarning):
        through_adapter = RolloutSampler(tok, old, eos, fmt)(
            model, ["xy"], params, 2, engine_logprobs=logprobs
        )
    direct = RolloutSampler(tok, old.hf, eos, fmt)(model, ["xy"], params, 2, engine_logprobs=logprobs)
    assert old.calls == [called]
    assert through_adapter.completions == direct.completions
    assert torch.equal(through_adapter.completion_mask, direct.completion_mask)
    if logprobs:
        torch.testing.assert_close(through_adapter.old_logp, direct.old_logp)


def test_an_old_engine_that_continues_runs_the_cached_tool_rounds():
    tok = make_tokenizer()
    model = scripted(tok, "Q:<<2*3=7>> so 6")
    old = OldHF(tok)
    with pytest.warns(DeprecationWarning):
        rollout = tool_sampler(tok, old)(model, ["Q:"], GREEDY, 2)
    assert rollout.completions == tool_sampler(tok, old.hf)(model, ["Q:"], GREEDY, 2).completions
    assert set(old.calls) == {"generate_continuing"}


def test_an_old_engine_without_the_variants_is_refused_what_it_cannot_give():
    tok = make_tokenizer()
    with pytest.warns(DeprecationWarning):
        sampler = RolloutSampler(tok, OldPlain(), [tok.eos_token_id], PromptFormat(False))
    model = make_model(len(tok))
    assert sampler(model, ["x"], SamplingParams(2), 2).completion_ids.tolist() == [[7, 7]] * 2
    with pytest.raises(ValueError, match="stop_strings"):
        sampler(model, ["x"], SamplingParams(2, stop=("=",)), 2)
    with pytest.raises(ValueError, match="OldPlain cannot give .* lack logprobs"):
        sampler(model, ["x"], SamplingParams(2), 2, engine_logprobs=True)
