"""Tool-using rollouts on more paths: the engine's log-probs (``use_engine_logprobs``,
``rollout_correction``) on the policy's tokens only, ``steps_per_generation``, LoRA, and async
rollouts on a rollout server with the tool loop on the trainer's side; one training batch each
through training/step.py, without a Trainer. Tools on vLLM are tested in
tests/rollout/engines/test_vllm_backend.py."""

from __future__ import annotations

import dataclasses
import io
import pickle

import pytest
import torch
from helpers.engines import TurnEngine
from helpers.models import ScriptedLlama, make_model, make_tokenizer, scripted
from helpers.tools import GREEDY, CallsAtLengths, add, call, chat_tokenizer, tiny, tool_sampler
from torch.distributed.fsdp import FSDPModule

from forge_lightning.rollout.engines.base import SamplingParams
from forge_lightning.rollout.in_flight import (
    Finished,
    InFlight,
    restored_in_flight,
    saved_in_flight,
)
from forge_lightning.rollout.logprobs import LogProbScorer
from forge_lightning.rollout.sampler import PromptFormat, RolloutSampler
from forge_lightning.rollout.sources import TrainingBatch
from forge_lightning.rollout.tools.recipe import ToolRecipe
from forge_lightning.run.fit import FitShape
from forge_lightning.serving.decode import DecodeLoop
from forge_lightning.serving.placement import refuse_unloadable_class
from forge_lightning.serving.server import RolloutServer
from forge_lightning.serving.wire import SECRET_ENV
from forge_lightning.settings.checks import validate_hparams
from forge_lightning.training.context import StepContext


@pytest.mark.parametrize("continues", [True, False])
def test_the_engines_log_probs_are_the_policys_on_its_tokens_and_zero_on_the_tools(continues):
    # A random model, sampled at temperature 0.7: rows call at different lengths, so rounds are
    # cut mid-writing (cached) or read whole again (not); each sampled token's score must be the
    # one the trainer computes for it at its place in the finished completion.
    tok = make_tokenizer()
    model = make_model(len(tok), seed=3, initializer_range=0.5)
    sampler = tool_sampler(tok, max_tool_calls=3)
    sampler.tools = CallsAtLengths(tok, {3, 9, 16})
    sampler._engine_continues = continues
    torch.manual_seed(0)
    params = SamplingParams(max_new_tokens=24, temperature=0.7)
    rollout = sampler(model, ["ab", "hello there", "q"], params, 2, engine_logprobs=True)

    mask = rollout.loss_mask()
    tool = rollout.completion_mask.bool() & ~rollout.model_mask.bool()
    assert tool.sum() >= 6 and mask.sum() > tool.sum()
    trainer = LogProbScorer(temperature=0.7).log_probs_no_grad(model, rollout)
    torch.testing.assert_close(rollout.old_logp[mask], trainer[mask], atol=1e-4, rtol=1e-4)
    assert (rollout.old_logp[~mask] == 0).all()  # the tools' tokens and the padding
    assert (trainer[tool] < -0.5).any()  # so a score taken at a tool's token would have shown


def train_one_batch(module, **settings):
    """One training batch of a calculator run on a model scripted to write ``<<2*3=7>>``: the
    calculator answers ``6>>``, a token the policy finds all but impossible (log-prob near -40)."""
    tok = make_tokenizer()
    grpo = module(
        model=scripted(tok, "Q:<<2*3=7>> ok"),
        tokenizer=tok,
        calculator="annotation",
        group_size=2,
        max_new_tokens=16,
        kl_beta=0.0,
        gradient_accumulation_steps=1,
        **settings,
    )
    grpo.configure_model()
    context = StepContext.one_process()
    [item] = grpo.rollout_source.rollouts(TrainingBatch(["Q:", "Q:"], {}, 0), context, grpo.model)
    optimizer = torch.optim.AdamW([p for p in grpo.model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    record, stepped = grpo.step.train(item, grpo.model, None, optimizer, scheduler, context)
    assert stepped and torch.isfinite(torch.tensor(record.metrics["train/loss"]))
    assert record.metrics["train/tool_calls"] == 1.0
    return grpo, item.rollout, record.metrics, scheduler.last_epoch


def test_engine_log_probs_with_tools_train_a_step_and_weigh_no_tool_token(module):
    validate_hparams({"calculator": "annotation", "use_engine_logprobs": True})
    grpo, rollout, metrics, _ = train_one_batch(module, use_engine_logprobs=True)
    tool = rollout.completion_mask.bool() & ~rollout.model_mask.bool()
    assert tool.sum() == 4 * 3  # "6>>" in each of the 2 x 2 rows
    assert (rollout.old_logp[tool] == 0).all()
    mask = rollout.loss_mask()
    trainer = grpo.scorer.log_probs_no_grad(grpo.model, rollout)
    assert (trainer[tool] < -20).any()  # weighed, the tool's tokens would give ratios of e^-20
    torch.testing.assert_close(rollout.old_logp[mask], trainer[mask], atol=1e-4, rtol=1e-4)
    assert metrics["train/clip_fraction"] == 0.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_with_tools_weighs_the_policys_tokens_only(module, level):
    validate_hparams({"calculator": "annotation", "rollout_correction": "mask"})
    _, rollout, metrics, _ = train_one_batch(
        module, rollout_correction="mask", rollout_correction_level=level
    )
    assert rollout.behav_logp is not None and rollout.old_logp is None
    # The tools' tokens (behav 0, the trainer's near -40) would make weights of e^-40 and a huge
    # sampler KL; on the policy's tokens the engine and the trainer agree.
    assert metrics["train/correction_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["train/correction_masked_fraction"] == 0.0
    assert metrics["train/sampler_kl"] == pytest.approx(0.0, abs=1e-4)


def test_a_low_precision_sampler_with_tools_samples_with_its_copy_and_weighs_no_tool_token(module):
    from forge_lightning.rollout.engines.quantized import QuantizedGenerate

    settings = {"rollout_precision": "bf16", "rollout_correction": "truncate"}
    validate_hparams({"calculator": "annotation", **settings})
    grpo, rollout, metrics, _ = train_one_batch(module, **settings)
    engine = grpo.engine
    assert isinstance(engine, QuantizedGenerate) and engine.sampling_copy is not None
    assert next(engine.sampling_copy.parameters()).dtype == torch.bfloat16  # the copy sampled
    tool = rollout.completion_mask.bool() & ~rollout.model_mask.bool()
    assert tool.sum() == 4 * 3 and (rollout.behav_logp[tool] == 0).all()
    # The tools' tokens, weighed, would give weights of e^-40: on the policy's alone they are ~1.
    assert metrics["train/correction_weight_mean"] == pytest.approx(1.0, abs=1e-2)
    assert metrics["train/sampler_kl"] < 1e-2


def test_two_steps_per_generation_with_tools_step_twice_on_one_rollout(module):
    _, rollout, _, steps = train_one_batch(module, steps_per_generation=2)
    assert steps == 2
    assert rollout.model_mask is not None and not rollout.model_mask.bool().all()


def test_a_lora_policy_with_tools_trains_a_step(module):
    pytest.importorskip("peft")
    from forge_lightning.models.lora import LoraSettings

    grpo, _, _, steps = train_one_batch(module, peft=LoraSettings(r=4, alpha=8, dropout=0.0))
    assert steps == 1 and any(".lora_" in n for n, _ in grpo.model.named_parameters())


@pytest.fixture
def scripted_server(monkeypatch):
    """``scripted_server(precision)``: a rollout server in this process holding the scripted model
    (its script in its forward, so the weights pushed into it keep it), sampling with a copy in
    ``precision``; its host:port, behind a secret the trainer gets."""
    servers = []

    def start(precision=None):
        monkeypatch.setenv(SECRET_ENV, "tools-secret")
        tok = make_tokenizer()
        model = scripted(tok, "Q:<<2*3=7>> ok", seed=2)
        server = RolloutServer(model, tok, "tools-secret", loop=DecodeLoop(model, tok, precision=precision))
        servers.append(server)
        return server.start().removeprefix("http://")

    yield start
    for server in servers:
        server.stop()


@pytest.mark.integration
@pytest.mark.parametrize(
    "setting",
    [{}, {"rollout_correction": "mask"}, {"rollout_correction": "truncate", "rollout_precision": "bf16"}],
)
def test_async_rollouts_run_the_calculator_on_the_trainers_side_and_the_batch_trains_a_step(
    module, scripted_server, tmp_path, setting
):
    validate_hparams({"calculator": "annotation", "rollout_mode": "async", **setting})
    tok = make_tokenizer()
    torch.manual_seed(0)
    address = scripted_server(setting.get("rollout_precision"))
    grpo = module(
        model=scripted(tok, "Q:<<2*3=7>> ok"),
        tokenizer=tok,
        calculator="annotation",
        rollout_mode="async",
        rollout_servers=[address],
        max_staleness=0,  # the batch handed is the batch trained
        group_size=2,
        max_new_tokens=16,
        kl_beta=0.0,
        gradient_accumulation_steps=1,
        **setting,
    )
    grpo.configure_model()
    source = grpo.rollout_source
    source.on_fit_start(FitShape(max_steps=1, root_dir=str(tmp_path)), grpo.model, sharded=False)
    try:
        context = StepContext.one_process()
        [item] = source.rollouts(TrainingBatch(["Q:"], {}, 0), context, grpo.model)
        rollout = item.rollout
        assert rollout.completions == ["<<2*3=6>> ok"] * 2  # this process's calculator answered
        assert rollout.tool_stats["tool_calls"].tolist() == [1, 1] and not any(rollout.environments or ())
        mask = rollout.loss_mask()
        tool = rollout.completion_mask.bool() & ~mask
        assert tool.sum() == 2 * 3  # "6>>", read but not trained on
        if setting:  # the server's log-probs of the policy's tokens: the trainer's own (a bf16 copy's: near)
            trainer = grpo.scorer.log_probs_no_grad(grpo.model, rollout)
            close = 1e-2 if "rollout_precision" in setting else 1e-4
            torch.testing.assert_close(rollout.behav_logp[mask], trainer[mask], atol=close, rtol=close)
            assert (rollout.behav_logp[tool] == 0).all()
        else:  # lag 0, no correction: the loss is the synchronous one
            assert rollout.behav_logp is None
        optimizer = torch.optim.AdamW(grpo.model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        record, stepped = grpo.step.train(item, grpo.model, None, optimizer, scheduler, context)
        assert stepped and record.metrics["train/tool_calls"] == 1.0
        if setting:
            weight_close = 1e-2 if "rollout_precision" in setting else 1e-3
            assert record.metrics["train/correction_weight_mean"] == pytest.approx(1.0, abs=weight_close)
    finally:
        source.close()


def test_a_model_of_a_class_of_its_own_is_refused_for_servers_the_trainer_starts():
    """A subclass with its own forward would be served as the class AutoModelForCausalLM builds."""
    tok = make_tokenizer()
    with pytest.raises(
        ValueError, match=r"builds .*LlamaForCausalLM from this model's config, not its class"
    ):
        refuse_unloadable_class(ScriptedLlama(make_model(len(tok)).config))
    refuse_unloadable_class(make_model(len(tok)))
    # FSDP2's fully_shard swaps in a subclass of its own, made in torch: the model's class all the same.
    llama = make_model(len(tok))
    where = {"__module__": "torch.distributed.fsdp._fully_shard._fully_shard"}  # as fully_shard makes it
    llama.__class__ = type("FSDPLlamaForCausalLM", (FSDPModule, type(llama)), where)
    refuse_unloadable_class(llama)


def test_an_environment_in_async_mode_is_refused_by_name_with_the_reason_and_tools_are_taken():
    with pytest.raises(
        ValueError, match=r"cannot take environment_factory='m.E': an environment is an object"
    ):
        validate_hparams({"environment_factory": "m.E", "rollout_mode": "async"})
    validate_hparams({"tools": ["json.dumps"], "rollout_mode": "async", "rollout_correction": "mask"})
    # The tools' loop runs on the trainer's side of its server, so in its sandbox too.
    validate_hparams({"tools": ["json.dumps"], "sandbox": "process", "rollout_mode": "async"})


def test_a_tool_rollout_in_flight_is_kept_in_a_checkpoint_and_comes_back_whole():
    tok = make_tokenizer()
    rollout = tool_sampler(tok)(scripted(tok, "Q:<<2*3=7>> ok"), ["Q:"], SamplingParams(16, greedy=True), 2)
    rollout = dataclasses.replace(rollout, environments=None)  # as the worker sends it
    finished = Finished(rollout.completion_ids, -torch.rand(rollout.completion_ids.shape), 3, rollout=rollout)
    item = InFlight(["Q:"], {"answer": ["6"]}, 0, index=0, ticket=1, finished=finished)
    buffer = io.BytesIO()
    torch.save({"in_flight": saved_in_flight([item])}, buffer)
    buffer.seek(0)
    [back] = restored_in_flight(torch.load(buffer, weights_only=True)["in_flight"])

    assert back.prompt_ids is None and back.finished.version == 3
    torch.testing.assert_close(back.finished.behav_logp, finished.behav_logp)
    kept = back.finished.rollout
    assert kept.tool_calls == rollout.tool_calls and kept.transcripts == rollout.transcripts
    assert kept.tool_calls[0][0]["result"] == "6" and kept.completions == rollout.completions
    for name in ("completion_ids", "completion_mask", "model_mask", "prompt_ids"):
        assert torch.equal(getattr(kept, name), getattr(rollout, name)), name
    assert kept.tool_stats.keys() == rollout.tool_stats.keys()


def test_function_tools_built_back_from_a_pickled_recipe_run_the_same_function():
    # The recipe pickles with its functions by reference (import path): plain data.
    tok = chat_tokenizer()
    recipe = pickle.loads(pickle.dumps(ToolRecipe(functions=(add,), max_tool_calls=2)))
    assert recipe.functions == (add,)
    engine = TurnEngine(tok, [call("add", a=2, b=3), "It is 5."])
    base = RolloutSampler(tok, engine, [tok.eos_token_id], PromptFormat(use_chat_template=True))
    rollout = recipe.runner(base)(tiny(tok), ["What is 2+3?"], GREEDY, 2)
    assert [calls[0]["result"] for calls in rollout.tool_calls] == ["5", "5"]
    assert rollout.completions[0].endswith("It is 5.")
