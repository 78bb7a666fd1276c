"""The throughput machinery gives the same numbers as the plain path, and the benchmark runs."""

from __future__ import annotations

import json
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import CHAT_TEMPLATE, make_model, make_tokenizer
from transformers import AutoModelForCausalLM

import forge_lightning.rollout.logprobs as logprobs_module
import forge_lightning.training.loss_passes as backward_module
from forge_lightning.bench import throughput as bench
from forge_lightning.reporting.profiler import PHASES, PhaseProfiler
from forge_lightning.rollout.engines.base import GenerationRequest, SamplingParams
from forge_lightning.rollout.engines.hf import HFGenerate
from forge_lightning.rollout.logprobs import LogProbScorer, completion_log_probs
from forge_lightning.rollout.sampler import encode_prompts
from forge_lightning.rollout.types import Rollout, completion_mask

EOS = 1
GROUP = 3


def left_padded_rollout() -> Rollout:
    """Three prompts of different lengths (so two are left-padded), G=3 completions each."""
    tok = make_tokenizer()
    prompt_ids, prompt_mask = encode_prompts(tok, ["ab", "hello there", "xyz q"], use_chat_template=False)
    assert prompt_mask[0].sum() < prompt_mask[1].sum()  # really padded
    torch.manual_seed(3)
    completions = torch.randint(4, len(tok), (3 * GROUP, 7))
    completions[1, 2] = EOS  # ends early; the rest of its row is after the EOS
    completions[5, 0] = EOS  # ends at once
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completions,
        completion_mask=completion_mask(completions, [EOS]),
        group_size=GROUP,
        completions=[""] * (3 * GROUP),
    )


def log_probs_and_grads(model: torch.nn.Module, rollout: Rollout, mode: str) -> tuple[torch.Tensor, list]:
    model.zero_grad()
    logp = completion_log_probs(
        model,
        rollout.prompt_ids,
        rollout.prompt_mask,
        rollout.completion_ids,
        group_size=GROUP,
        temperature=0.7,
        mode=mode,
        chunk_size=5,
    )
    weights = torch.linspace(-1, 1, logp.numel()).view_as(logp)
    (logp * weights * rollout.completion_mask).sum().backward()
    return logp.detach(), [p.grad.clone() for p in model.parameters()]


def test_shared_prefix_log_probs_and_gradients_equal_the_full_forward():
    model = make_model(len(make_tokenizer()))
    rollout = left_padded_rollout()
    full_logp, full_grads = log_probs_and_grads(model, rollout, "full")
    shared_logp, shared_grads = log_probs_and_grads(model, rollout, "shared_prefix")
    mask = rollout.completion_mask.bool()
    torch.testing.assert_close(shared_logp[mask], full_logp[mask], rtol=1e-5, atol=1e-5)
    for shared, full in zip(shared_grads, full_grads):
        torch.testing.assert_close(shared, full, rtol=1e-4, atol=1e-6)


@pytest.mark.integration
def test_step_loss_and_gradient_do_not_depend_on_prefix_sharing(step_gradients):
    full_loss, full_grads = step_gradients(prefix_sharing=False)
    shared_loss, shared_grads = step_gradients(prefix_sharing=True)
    assert any(g.abs().sum() > 0 for g in full_grads)
    assert shared_loss == pytest.approx(full_loss, rel=1e-5, abs=1e-6)
    for shared, full in zip(shared_grads, full_grads):
        torch.testing.assert_close(shared, full, rtol=1e-4, atol=1e-6)


def record_forward_modes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    modes: list[str] = []
    original = logprobs_module.completion_states

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        modes.append(kwargs["mode"])
        return original(*args, **kwargs)

    monkeypatch.setattr(logprobs_module, "completion_states", spy)
    return modes


@pytest.mark.integration
def test_gradient_checkpointing_falls_back_to_the_full_forward_and_warns_once(
    tmp_path, monkeypatch, module, trainer, loader
):
    modes = record_forward_modes(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = trainer(tmp_path, max_steps=2)
        fit.fit(
            module(gradient_checkpointing=True, gradient_accumulation_steps=1), loader([{"prompt": "q"}] * 2)
        )
    assert fit.global_step == 2
    assert sum("prefix sharing is off" in str(w.message) for w in caught) == 1
    assert modes and set(modes) == {"full"}


@pytest.mark.integration
def test_without_checkpointing_the_training_forwards_share_the_prefix(
    tmp_path, monkeypatch, module, trainer, loader
):
    modes = record_forward_modes(monkeypatch)
    trainer(tmp_path, max_steps=1).fit(module(gradient_accumulation_steps=1), loader([{"prompt": "q"}]))
    assert modes and set(modes) == {"shared_prefix"}


@pytest.mark.integration
def test_two_iterations_step_twice_per_batch_and_move_the_ratio_on_the_second_pass(
    tmp_path, monkeypatch, module, trainer, loader
):
    passes: list[dict[str, torch.Tensor]] = []
    old_forwards: list[bool] = []
    original_loss = backward_module.grpo_loss
    original_no_grad = LogProbScorer.log_probs_no_grad

    def loss_spy(logp, old_logp, ref_logp, advantages, mask, settings, behav_logp=None):
        loss, metrics = original_loss(logp, old_logp, ref_logp, advantages, mask, settings, behav_logp)
        log_ratio = (logp.detach() - old_logp)[mask.bool()]
        passes.append({"max_log_ratio": log_ratio.abs().max(), "clip": metrics["clip_fraction_low"]})
        return loss, metrics

    def no_grad_spy(self, model, rollout):
        old_forwards.append(model is grpo.model)
        return original_no_grad(self, model, rollout)

    monkeypatch.setattr(backward_module, "grpo_loss", loss_spy)
    monkeypatch.setattr(LogProbScorer, "log_probs_no_grad", no_grad_spy)
    pl.seed_everything(0)
    grpo = module(num_iterations=2, gradient_accumulation_steps=1, learning_rate=3e-2, group_size=8)
    fit = trainer(tmp_path, profiler=PhaseProfiler())
    fit.fit(grpo, loader([{"prompt": "ab"}, {"prompt": "cd"}]))

    assert fit.global_step == 4  # 2 batches x 2 optimizer steps
    assert old_forwards.count(True) == 2  # the old policy's log-probs: once per batch, not per pass
    first, second = passes[0::2], passes[1::2]
    assert all(p["max_log_ratio"] < 1e-5 for p in first)  # before any step: the sampling policy
    assert all(p["max_log_ratio"] > 1e-3 for p in second)  # after one step: the ratio moved off 1
    assert set(grpo.last_step.phases) == set(PHASES)
    assert all(seconds > 0 for seconds in grpo.last_step.phases.values())


def test_generation_runs_each_prompt_once_and_decodes_as_plain_generate_does():
    tok = make_tokenizer()
    model = make_model(len(tok))
    prompt_ids, prompt_mask = encode_prompts(tok, ["ab", "hello there"], use_chat_template=False)
    batch_sizes: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kw: batch_sizes.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    greedy = SamplingParams(max_new_tokens=6, greedy=True)
    request = GenerationRequest(prompt_ids, prompt_mask, GROUP, greedy)
    ours = HFGenerate(tok.pad_token_id, [EOS]).generate(model, request).ids
    hook.remove()
    assert batch_sizes[0] == 2  # the prompts' forward: once per prompt, not once per completion
    plain = model.generate(
        input_ids=prompt_ids.repeat_interleave(GROUP, 0),
        attention_mask=prompt_mask.repeat_interleave(GROUP, 0),
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=EOS,
    )
    assert torch.equal(ours, plain[:, prompt_ids.shape[1] :])


def write_gsm8k(folder) -> None:
    rows = [("What is 2 + 3?", "#### 5"), ("What is 10 - 4?", "#### 6"), ("Double 7?", "#### 14")]
    lines = [json.dumps({"question": q, "answer": a}) for q, a in rows]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.integration
def test_bench_prints_one_json_line_of_positive_figures(tiny_model_dir, tmp_path, capsys):
    write_gsm8k(tmp_path)
    args = ["--model", str(tiny_model_dir), "--data", str(tmp_path), "--steps", "2", "--group", "2"]
    result = bench.main([*args, "--prompts-per-step", "2", "--max-new-tokens", "5", "--fixed-length"])

    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == result
    figures = [
        "completion_tokens_per_s",
        "seconds_per_step",
        *(f"time_{phase}_s" for phase in bench.PHASES),
        "generate_seconds_per_step",
        "straightforward_seconds_per_step",
        "setup_rss_mb",
        "peak_rss_mb",
    ]
    for key in figures:
        assert result[key] > 0, key
    assert result["completion_tokens_per_step"] == 2 * 2 * 5  # fixed length: every token kept
    assert result["settings"]["prompts_per_step"] == 2 and result["settings"]["fixed_length"]


def test_bench_without_data_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--steps", "1"])
    assert "--data" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--data", str(tmp_path / "missing")])
    assert "no such file or folder" in capsys.readouterr().err


@pytest.mark.integration
def test_bench_compare_prints_a_sync_and_an_async_line(tiny_model_dir, tmp_path, capsys):
    write_gsm8k(tmp_path)
    args = ["--model", str(tiny_model_dir), "--data", str(tmp_path), "--steps", "2", "--group", "2"]
    result = bench.main([*args, "--max-new-tokens", "4", "--rollout-mode", "compare", "--threads", "2"])

    sync, asyn = map(json.loads, capsys.readouterr().out.strip().splitlines())
    assert asyn == result
    assert sync["settings"]["rollout_mode"] == "sync" and asyn["settings"]["rollout_mode"] == "async"
    assert asyn["settings"]["threads"] == 2  # split between the trainer and its local:1 server:
    assert asyn["settings"]["trainer_threads"] == 1 and asyn["settings"]["worker_threads"] == 1
    assert asyn["settings"]["rollout_servers"] == ["local:1"]
    assert asyn["vs_sync"] == pytest.approx(asyn["completion_tokens_per_s"] / sync["completion_tokens_per_s"])
    assert 0 <= asyn["trainer_wait_share"] <= 1 and "worker_wait_share" not in asyn  # a server reports none
    assert "generate_seconds_per_step" in sync and "generate_seconds_per_step" not in asyn


@pytest.mark.integration
def test_bench_generation_compare_prints_its_four_lines_per_round(tiny_model_dir, tmp_path, capsys):
    write_gsm8k(tmp_path)
    args = ["--model", str(tiny_model_dir), "--data", str(tmp_path), "--steps", "4", "--group", "2"]
    bench.main([*args, "--max-new-tokens", "3", "--fixed-length", "--generation-compare", "--no-references"])

    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    shapes = [(r["settings"]["steps_per_generation"], r["settings"]["engine_logprobs"]) for r in lines]
    assert shapes == [(1, False), (4, False), (4, True), (1, False)]
    assert [r["settings"]["prompts_per_step"] for r in lines] == [1, 1, 1, 4]
    # Timed: 4 optimizer steps each, after one warm-up generation; S = 4 samples 4 prompts at once.
    assert [r["completion_tokens_per_step"] for r in lines] == [2 * 3, 4 * 2 * 3, 4 * 2 * 3, 4 * 2 * 3]
    for r in lines:
        assert 0 < r["generate_share"] < 1 and r["completion_tokens_per_s"] > 0
    with pytest.raises(SystemExit):
        bench.main([*args, "--steps", "3", "--steps-per-generation", "2"])
    assert "not a multiple" in capsys.readouterr().err


@pytest.mark.integration
def test_bench_with_an_int8_sampler_corrects_by_its_logprobs(tiny_model_dir, tmp_path, capsys):
    write_gsm8k(tmp_path)
    args = ["--model", str(tiny_model_dir), "--data", str(tmp_path), "--steps", "1", "--group", "2"]
    result = bench.main([*args, "--max-new-tokens", "4", "--no-references", "--rollout-precision", "int8"])
    assert result["settings"]["rollout_precision"] == "int8" and result["completion_tokens_per_s"] > 0
    with pytest.raises(SystemExit):
        bench.main([*args, "--rollout-precision", "int8", "--engine-logprobs"])
    assert "--rollout-precision corrects by the sampler's log-probs" in capsys.readouterr().err


@pytest.mark.integration
def test_bench_endpoint_compare_runs_the_tool_loop_and_the_agent_on_the_same_episodes(
    tiny_model_dir, tmp_path, capsys
):
    write_gsm8k(tmp_path)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_model_dir), make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE  # the tool turns need a template, the tools' schemas not
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    agent = "forge_lightning.examples.calculator_agent"
    args = ["--model", str(tmp_path / "model"), "--data", str(tmp_path), "--steps", "1", "--group", "2"]
    routes = ["--agent", f"{agent}.agent", "--tools", f"{agent}.calculate", f"{agent}.answer"]
    bench.main([*args, "--max-new-tokens", "4", "--endpoint-compare", *routes, "--rounds", "2"])

    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [(r["round"], bool(r["settings"]["agent"]), bool(r["settings"]["tools"])) for r in lines] == [
        (0, False, True), (0, True, False), (1, False, True), (1, True, False),
    ]  # fmt: skip
    for tool_loop, endpoint in zip(lines[::2], lines[1::2]):
        assert tool_loop["sampled_tokens_per_step"] > 0 and "vs_tool_loop" not in tool_loop
        ratio = endpoint["generate_tokens_per_s"] / tool_loop["generate_tokens_per_s"]
        assert endpoint["vs_tool_loop"] == pytest.approx(ratio)
    with pytest.raises(SystemExit):
        bench.main([*args, "--endpoint-compare", "--agent", f"{agent}.agent"])
    assert "give both" in capsys.readouterr().err


@pytest.mark.integration
def test_bench_phase_memory_gives_each_phases_peak_and_takes_the_lm_head_setting(tiny_model_dir, tmp_path):
    write_gsm8k(tmp_path)
    args = ["--model", str(tiny_model_dir), "--data", str(tmp_path), "--steps", "1", "--group", "2"]
    result = bench.main(
        [*args, "--max-new-tokens", "4", "--no-references", "--phase-memory", "--lm-head-chunk-size", "0"]
    )
    assert result["settings"]["lm_head_chunk_size"] == 0
    increases = {
        phase: result[f"peak_rss_{phase}_increase_mb"] for phase in ("generate", "logprob", "backward")
    }
    setup = result["setup_rss_mb"]
    assert all(setup + increase > 0 for increase in increases.values())  # a peak resident size each
    assert result["peak_rss_mb"] >= max(setup + i for i in increases.values())  # the step's: its phases'
    assert bench._head_chunks(None) == {} and bench._head_chunks(0) == {"lm_head_chunk_size": None}
    assert result["settings"]["gradient_checkpointing"] is False
    checkpointed = bench.main([*args, "--max-new-tokens", "4", "--no-references", "--gradient-checkpointing"])
    assert checkpointed["settings"]["gradient_checkpointing"] is True
    assert checkpointed["completion_tokens_per_step"] == result["completion_tokens_per_step"]
