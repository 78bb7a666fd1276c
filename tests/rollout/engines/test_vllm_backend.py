"""The vLLM backend on CPU, through a fake engine with ``vllm.LLM``'s interface (no vLLM, no GPU).

The fake ``vllm`` module put in ``sys.modules`` stands in for the import; the fake engine answers
``generate(prompts, sampling_params)`` with scripted completions, and records every weight load
that reaches its model through ``apply_model``.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers.fake_vllm import EOS, TOKEN_LOGP, CalculatorLLM, FakeLLM, fake_vllm_module
from helpers.models import make_model, make_tokenizer
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from forge_lightning.bench import throughput as bench
from forge_lightning.grpo import grpo_loss
from forge_lightning.module import GRPOLightningModule
from forge_lightning.rollout.engines.base import GenerationRequest, SamplingParams
from forge_lightning.rollout.engines.hf import HFGenerate
from forge_lightning.rollout.engines.vllm import VLLMGenerate, colocated_llm, import_vllm, policy_weights
from forge_lightning.rollout.sources import TrainingBatch
from forge_lightning.rollout.types import completion_mask
from forge_lightning.settings.checks import validate_hparams
from forge_lightning.training.context import StepContext


@pytest.fixture(autouse=True)
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    module = fake_vllm_module()
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


def backend(engines: list[FakeLLM] | None = None) -> VLLMGenerate:
    tok = make_tokenizer()
    token_a = tok.convert_tokens_to_ids("a")
    engines = engines if engines is not None else []

    def factory(model: Any, tokenizer: Any, gpu_memory_utilization: float) -> FakeLLM:
        engines.append(FakeLLM(token_a))
        return engines[-1]

    return VLLMGenerate(tok, [EOS], gpu_memory_utilization=0.3, engine_factory=factory)


def vllm_module(module: Any, engines: list[FakeLLM], **kwargs: Any) -> GRPOLightningModule:
    """``module(**kwargs)`` (the conftest factory) with the vLLM backend on a fake engine."""
    settings = dict(
        max_new_tokens=6,
        learning_rate=1e-2,
        kl_beta=0.0,
        gradient_accumulation_steps=1,
        generation_backend="vllm",
    )
    grpo = module(**{**settings, **kwargs})
    grpo.engine = backend(engines)  # the constructor hook: configure_model keeps a set generator
    return grpo


def test_sampling_settings_map_onto_vllm_sampling_params():
    engines: list[FakeLLM] = []
    gen = backend(engines)
    ids = torch.tensor([[5, 6], [7, 8]])
    gen.generate(
        make_model(60),
        GenerationRequest(ids, torch.ones_like(ids), 3, SamplingParams(5, 0.7, top_p=0.9, top_k=0)),
    )
    gen.generate(
        make_model(60), GenerationRequest(ids, torch.ones_like(ids), 3, SamplingParams(5, 0.7, top_k=20))
    )
    greedy = SamplingParams(5, 0.7, top_k=20, greedy=True)
    gen.generate(make_model(60), GenerationRequest(ids, torch.ones_like(ids), 1, greedy))

    (_, sampled), (_, top_k), (_, greedy) = engines[0].requests
    first = vars(sampled[0])
    assert {k: v for k, v in first.items() if k != "seed"} == {
        "n": 3,
        "max_tokens": 5,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,  # 0 (off) here is -1 in vLLM
        "stop_token_ids": [EOS],
        "logprobs": None,
        "detokenize": False,
    }
    assert sampled[1].seed == sampled[0].seed + 3  # each completion of the rollout its own stream
    assert top_k[0].top_k == 20
    assert (greedy[0].temperature, greedy[0].top_p, greedy[0].top_k, greedy[0].n) == (0.0, 1.0, -1, 1)


def test_prompts_reach_the_engine_without_their_left_padding():
    engines: list[FakeLLM] = []
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    backend(engines).generate(make_model(60), GenerationRequest(ids, mask, 2, SamplingParams(4)))
    prompts, _ = engines[0].requests[0]
    assert prompts == [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8, 9, 10]}]


def test_completions_come_back_right_padded_with_groups_contiguous_and_ending_at_eos():
    gen = backend()
    a = gen.tokenizer.convert_tokens_to_ids("a")
    ids = torch.tensor([[5, 6], [7, 8]])
    completions = gen.generate(
        make_model(60), GenerationRequest(ids, torch.ones_like(ids), 4, SamplingParams(4))
    ).ids
    pad = gen.pad_token_id
    group = [
        [a, EOS, pad, pad],
        [a, a, EOS, pad],
        [a, a, a, EOS],
        [a, a, a, a],  # hit max_tokens: no EOS
    ]
    assert completions.tolist() == group + group  # (P*G, Lc): prompt 0's four, then prompt 1's
    mask = completion_mask(completions, [EOS])
    assert mask.sum(dim=1).tolist() == [2, 3, 4, 4] * 2  # each up to and including its EOS


def test_engine_logprobs_are_the_sampled_tokens_log_probs_padded_with_zero():
    gen = backend()
    ids = torch.tensor([[5, 6]])
    out = gen.generate(
        make_model(60), GenerationRequest(ids, torch.ones_like(ids), 2, SamplingParams(4), logprobs=True)
    )
    completions, logp = out.ids, out.logp
    assert logp.shape == completions.shape and logp.dtype == torch.float32
    assert logp.tolist() == [[TOKEN_LOGP, TOKEN_LOGP, 0.0], [TOKEN_LOGP] * 3]


def test_engine_is_built_once_and_gets_the_policy_weights_first():
    engines: list[FakeLLM] = []
    gen = backend(engines)
    policy = make_model(60)
    gen.sync_weights(policy)  # before the first rollout there is no engine: nothing to do
    ids = torch.tensor([[5, 6]])
    for _ in range(2):
        gen.generate(policy, GenerationRequest(ids, torch.ones_like(ids), 2, SamplingParams(3)))
    assert len(engines) == 1
    (loaded,) = engines[0].model.loads
    assert loaded.keys() == dict(policy.named_parameters()).keys()
    for name, param in policy.named_parameters():
        torch.testing.assert_close(loaded[name], param.detach())


@pytest.mark.integration
def test_weights_reach_the_engine_after_every_optimizer_step(tmp_path, module, trainer, loader):
    engines: list[FakeLLM] = []
    grpo = vllm_module(module, engines)
    fit = trainer(tmp_path, max_steps=3)
    fit.fit(grpo, loader([{"prompt": f"q{i}"} for i in range(3)]))

    assert fit.global_step == 3
    loads = engines[0].model.loads
    assert len(loads) == 1 + 3  # the first rollout's load, then one per optimizer step
    assert engines[0].prefix_cache_resets == len(loads)
    assert any(not torch.equal(loads[0][k], loads[-1][k]) for k in loads[0])  # training moved them
    for name, param in grpo.model.named_parameters():
        torch.testing.assert_close(loads[-1][name], param.detach())


def test_engine_logprobs_are_the_old_logprobs_of_the_loss(module):
    engines: list[FakeLLM] = []
    grpo = vllm_module(module, engines, use_engine_logprobs=True, temperature=1.0)
    grpo.configure_model()
    rollout = grpo.episodes(grpo.model, ["ab"], grpo.sampling, 4, engine_logprobs=True)
    assert engines[0].requests[0][1][0].logprobs == 0
    expected = torch.where(rollout.completion_mask.bool(), TOKEN_LOGP, 0.0)
    torch.testing.assert_close(rollout.old_logp, expected)

    def clip_fraction(old_logp: torch.Tensor | None) -> float:
        logp = grpo.scorer.log_probs_no_grad(grpo.model, rollout)
        settings = dataclasses.replace(grpo.settings.loss, kl_beta=0.0)
        advantages = torch.full((4,), -1.0)
        _, metrics = grpo_loss(logp, old_logp, None, advantages, rollout.completion_mask, settings)
        return float(metrics["clip_fraction_low"] + metrics["clip_fraction_high"])

    # The random policy's log-probs are far below -0.25: against the engine's, every ratio is
    # under 1 - eps, clipped for a negative advantage; against the policy's own, every ratio is 1.
    assert clip_fraction(expected) == pytest.approx(1.0)
    assert clip_fraction(None) == 0.0


@pytest.mark.parametrize("setting", [{}, {"use_engine_logprobs": True}, {"rollout_correction": "mask"}])
def test_calculator_rounds_on_vllm_train_a_step_with_the_engines_log_probs_on_the_policys_tokens(
    module, setting
):
    validate_hparams({"calculator": "annotation", "generation_backend": "vllm", **setting})
    tok = make_tokenizer()
    engine = CalculatorLLM(tok)
    grpo = vllm_module(module, [], calculator="annotation", group_size=2, max_new_tokens=16, **setting)
    grpo.engine = VLLMGenerate(tok, [EOS], engine_factory=lambda *_: engine)
    grpo.configure_model()
    context = StepContext.one_process()
    [item] = grpo.rollout_source.rollouts(TrainingBatch(["Q:"], {}, 0), context, grpo.model)

    rollout = item.rollout
    assert rollout.completions == ["<<2*3=6>> ok"] * 2  # cut at the call, answered, then read whole
    assert len(engine.requests) == 2  # two rounds
    mask = rollout.loss_mask()
    assert (rollout.completion_mask.bool() & ~mask).sum() == 2 * 3  # the calculator's "6>>"
    engine_logp = rollout.behav_logp if "rollout_correction" in setting else rollout.old_logp
    if setting:  # the engine's log-prob on each sampled token, 0 on the calculator's and the padding
        torch.testing.assert_close(engine_logp, torch.where(mask, TOKEN_LOGP, 0.0))
    else:
        assert engine_logp is None and rollout.behav_logp is None
    trainer_logp = grpo.scorer.log_probs_no_grad(grpo.model, rollout)
    optimizer = torch.optim.AdamW(grpo.model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    record, stepped = grpo.step.train(item, grpo.model, None, optimizer, scheduler, context)
    assert stepped and torch.isfinite(torch.tensor(record.metrics["train/loss"]))
    if "rollout_correction" in setting:  # the weights of the policy's tokens alone, by hand
        weight = torch.exp(trainer_logp - TOKEN_LOGP)[mask]
        assert (weight < 3.0).all()  # none above the cap
        assert record.metrics["train/correction_weight_mean"] == pytest.approx(float(weight.mean()), rel=1e-4)


def test_hf_stays_the_default_backend():
    tok = make_tokenizer()
    grpo = GRPOLightningModule(model=make_model(len(tok)), tokenizer=tok)
    grpo.configure_model()
    assert isinstance(grpo.engine, HFGenerate) and grpo.episodes.generator is grpo.engine


@pytest.mark.integration
def test_benchmark_backend_flag_selects_the_vllm_engine(tiny_model_dir, tmp_path, monkeypatch):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"question": "{i}+1?", "answer": "#### {i + 1}"}}\n' for i in range(2)))
    engines: list[FakeLLM] = []

    def fake_colocated_llm(model: Any, tokenizer: Any, gpu_memory_utilization: float) -> FakeLLM:
        engines.append(FakeLLM(tokenizer.convert_tokens_to_ids("a")))
        return engines[-1]

    monkeypatch.setattr("forge_lightning.rollout.engines.vllm.colocated_llm", fake_colocated_llm)
    args = ["--data", str(data), "--model", str(tiny_model_dir), "--device", "cpu", "--backend", "vllm"]
    result = bench.main([*args, "--steps", "1", "--group", "2", "--max-new-tokens", "4", "--no-references"])
    assert result["settings"]["backend"] == "vllm"
    assert len(engines) == 1 and len(engines[0].requests) == 2  # the warm-up step and the timed one


def test_missing_vllm_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an uninstalled package looks like to import
    with pytest.raises(ImportError, match=r"forge-lightning\[vllm\]"):
        import_vllm()


def test_default_engine_is_a_colocated_llm_with_the_policys_config(fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    tok = make_tokenizer()
    policy = make_model(len(tok)).to(torch.bfloat16)
    colocated_llm(policy, tok, 0.25)
    (kwargs,) = fake_vllm.built
    assert kwargs["load_format"] == "dummy" and kwargs["gpu_memory_utilization"] == 0.25
    assert kwargs["dtype"] == "bfloat16" and kwargs["logprobs_mode"] == "processed_logprobs"
    assert "distributed_executor_backend" not in kwargs  # one process: no external launcher
    assert AutoConfig.from_pretrained(kwargs["model"]).num_hidden_layers == 2
    assert len(AutoTokenizer.from_pretrained(kwargs["tokenizer"])) == len(tok)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_lora_adapters_are_merged_into_the_weights_sent_to_the_engine():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = make_model(60)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    lora = peft.get_peft_model(model, config)
    sent = dict(policy_weights(lora))
    before = {k: v.clone() for k, v in lora.state_dict().items()}

    merged = dict(copy.deepcopy(lora).merge_and_unload().named_parameters())
    base_q = lora.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.equal(sent["model.layers.0.self_attn.q_proj.weight"], base_q)  # the adapter counts
    assert sent.keys() == merged.keys()
    for name, weight in merged.items():
        torch.testing.assert_close(sent[name], weight.detach())
    for key, value in lora.state_dict().items():  # the policy itself is left as it was
        assert torch.equal(value, before[key])


@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None, reason="needs 1 GPU and vLLM"
)
def test_real_engine_trains_and_follows_the_policy_on_a_gpu(tmp_path, monkeypatch, trainer, loader, count_a):
    monkeypatch.delitem(sys.modules, "vllm")  # the real package, not this file's fake
    tok = make_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(  # head_dim 64: a size every vLLM attention backend takes
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=True,
    )
    grpo = GRPOLightningModule(
        model=LlamaForCausalLM(config),
        tokenizer=tok,
        reward=count_a,
        group_size=4,
        max_new_tokens=8,
        learning_rate=1e-2,
        kl_beta=0.0,
        gradient_accumulation_steps=1,
        generation_backend="vllm",
        vllm_gpu_memory_utilization=0.2,
        use_engine_logprobs=True,
        temperature=1.0,
    )
    fit = trainer(tmp_path, accelerator="gpu", devices=1, max_steps=2)
    fit.fit(grpo, loader([{"prompt": f"q{i}"} for i in range(2)]))

    assert fit.global_step == 2
    engine_embed = grpo.engine.engine.apply_model(lambda m: m.model.embed_tokens.weight[: len(tok)].cpu())[0]
    policy_embed = grpo.model.model.embed_tokens.weight.detach().cpu()
    torch.testing.assert_close(engine_embed.float(), policy_embed.float())
