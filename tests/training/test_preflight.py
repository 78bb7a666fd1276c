"""The worst-case first step: what it runs, what it leaves as it was, when it stops a run and what
it suggests then."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.models import make_model, make_tokenizer

from forge_lightning.grpo import LossSettings
from forge_lightning.rollout.engines.base import (
    Completions,
    EngineCapabilities,
    GenerationRequest,
    SamplingParams,
)
from forge_lightning.rollout.engines.hf import HFGenerate
from forge_lightning.rollout.logprobs import LogProbScorer
from forge_lightning.training.context import StepContext
from forge_lightning.training.loss_passes import LossPasses
from forge_lightning.training.peak_memory import GB, PeakMemory, Phase
from forge_lightning.training.preflight import (
    Engine,
    PreflightError,
    PreflightReport,
    WorstCase,
    data_longest_prompt,
    longest_prompt,
    optimizer_state_bytes,
    run_preflight,
    training_prompts,
)
from forge_lightning.training.preflight_advice import check_preflight, suggestions

MB = 2**20


class RecordingEngine:
    """An engine that records what it is asked to generate and returns full-length rows."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], int, SamplingParams]] = []

    capabilities = EngineCapabilities()

    def generate(self, model, request: GenerationRequest) -> Completions:
        self.calls.append((tuple(request.prompt_ids.shape), request.group_size, request.params))
        return Completions(
            torch.full((request.prompt_ids.shape[0] * request.group_size, request.params.max_new_tokens), 5)
        )

    def sync_weights(self, model) -> None:
        pass


def passes(**scorer) -> LossPasses:
    return LossPasses(LogProbScorer(**scorer), LossSettings(kl_beta=0.05), False)


def preflight(model, loss_passes, engine=None, case=WorstCase(24, 16, 2, 4), limit=100 * GB):
    return run_preflight(model, loss_passes, engine, case, 5, StepContext.one_process(), limit, 0)


def report(training_peak: int, generation_peak: int | None = None, *, rows=8, tokens=320) -> PreflightReport:
    """A report of a process at 1 GiB before the preflight, with a limit of 2 GiB (sizes in MiB)."""
    generation = None if generation_peak is None else Phase(1024 * MB, generation_peak * MB)
    return PreflightReport(
        "CPU RSS", 1024 * MB, generation, Phase(1024 * MB, training_peak * MB), rows, tokens, 0, 2 * GB, 1.0
    )


def test_preflight_leaves_weights_gradients_normaliser_and_rng_as_they_were():
    tok = make_tokenizer()
    model = make_model(len(tok))
    loss_passes = passes(micro_batch_size=4)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    loss_passes.count = torch.tensor(3.0)
    rng = torch.random.get_rng_state()
    engine = Engine(HFGenerate(tok.pad_token_id, [tok.eos_token_id]), SamplingParams(16), "hf")
    measured = preflight(model, loss_passes, engine)
    assert measured.rows == 4 and measured.generation is not None
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.grad is None, name
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert loss_passes.count.item() == 3.0


def test_a_gradient_already_accumulated_is_put_back_as_it_was():
    model = make_model(95)
    model(torch.ones(1, 3, dtype=torch.long)).logits.sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    preflight(model, passes())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name]), name


def test_the_engine_generates_every_completion_to_max_new_tokens_for_the_whole_batch():
    engine = RecordingEngine()
    sampling = SamplingParams(16, temperature=0.7, stop=("\n",), extra={"typical_p": 0.9})
    preflight(make_model(95), passes(), Engine(engine, sampling, "hf"), WorstCase(24, 16, 3, 4))
    [(shape, group, params)] = engine.calls
    assert shape == (3, 24) and group == 4
    assert params.extra == {"typical_p": 0.9, "min_new_tokens": 16} and params.stop == ()
    assert params.temperature == 0.7
    vllm = RecordingEngine()
    preflight(make_model(95), passes(), Engine(vllm, SamplingParams(16), "vllm"))
    assert vllm.calls[0][2].extra == {"min_tokens": 16}


@pytest.mark.parametrize(
    ("scorer", "rows", "tokens"),
    [
        ({}, 8, 2 * 24 + 8 * 16),  # every row at once, each group's prompt once
        # Rows 0-2 share group 0's prompt, rows 3-5 cross into group 1: each runs its own, the largest.
        ({"micro_batch_size": 3}, 3, 3 * (24 + 16)),
        ({"micro_batch_size": 4}, 4, 24 + 4 * 16),  # one group a micro-batch: its prompt once
        ({"micro_batch_size": 2}, 2, 24 + 2 * 16),  # half a group: its prompt once
        ({"micro_batch_tokens": 150}, 4, 24 + 4 * 16),  # a group (88 tokens) fits 150, two (176) do not
        ({"micro_batch_tokens": 100, "shared_prefix": False}, 2, 2 * (24 + 16)),
    ],
)
def test_the_training_side_runs_one_micro_batch_as_the_step_splits_it(scorer, rows, tokens):
    measured = preflight(make_model(95), passes(**scorer))
    assert (measured.rows, measured.tokens) == (rows, tokens)


def test_a_long_prompt_batch_over_the_limit_stops_with_the_measured_peak():
    model = make_model(95, max_position_embeddings=1024)
    measured = preflight(model, passes(), case=WorstCase(512, 256, 2, 4), limit=64 * MB)
    assert measured.training.peak > 64 * MB and measured.over
    with pytest.raises(PreflightError, match=r"^Preflight: the worst-case first step \(2 prompts x 4 "
                       r"completions of 512 prompt \+ 256 new tokens\) peaks at .* CPU RSS, over the "
                       r"limit of 64.0 MiB") as stopped:  # fmt: skip
        check_preflight(measured, WorstCase(512, 256, 2, 4), False, StepContext.one_process())
    assert "To fit it, change one of:\n  " in str(stopped.value)


def test_a_batch_under_the_limit_passes():
    measured = preflight(make_model(95), passes())
    check_preflight(measured, WorstCase(24, 16, 2, 4), False, StepContext.one_process())
    assert measured.summary().startswith("Preflight: the worst case peaks at ")


def test_the_suggestions_are_sized_from_the_cost_per_row_and_per_token():
    # 8 rows of 24 + 16 tokens added 2 GiB: 256 MiB a row, 6.4 MiB a token; 1 GiB of room.
    case = WorstCase(24, 16, 2, 4)
    assert suggestions(report(3072, rows=8, tokens=8 * 40), case, gradient_checkpointing=False) == [
        "train_micro_batch_size: 4 (now 8 rows; 0.25 GiB each)",
        "train_micro_batch_tokens: 160 (a row of the worst case is 40)",
        "gradient_checkpointing: true (each layer's activations recomputed in the backward)",
        # the 8 rows' 128 completion tokens leave 32 of the 160 for their 8 prompts
        "max_prompt_length: 4 (now 24; longer prompts are cut)",
    ]
    # Gradient checkpointing on already is not suggested again; long prompts are: one row of
    # 200 + 16 tokens adds 2 GiB, so 1 GiB holds a row of 108 tokens, 92 of them prompt.
    assert suggestions(report(3072, rows=1, tokens=216), WorstCase(200, 16, 1, 2), True) == [
        "max_prompt_length: 92 (now 200; longer prompts are cut)"
    ]


def test_a_generation_over_the_limit_suggests_fewer_prompts_then_fewer_new_tokens():
    # The training side fits (1.5 GiB); the generation of 4 prompts adds 2 GiB: 512 MiB each.
    assert suggestions(report(1536, 3072), WorstCase(24, 16, 4, 4), False) == [
        "data.prompts_per_step: 2 (now 4; gradient_accumulation_steps up to keep the step's prompts; "
        "the generation of 16 rows added 2.00 GiB)"
    ]
    # One prompt's generation of 24 + 40 tokens adds 2 GiB: 32 MiB a token, 1 GiB holds 32 of them.
    assert suggestions(report(1536, 3072), WorstCase(24, 40, 1, 4), False) == [
        "max_new_tokens: 8 (now 40; one prompt's generation is over)"
    ]


def test_a_process_over_the_limit_before_the_preflight_is_told_so():
    over = PreflightReport("CPU RSS", 3 * GB, None, Phase(3 * GB, 3 * GB), 8, 320, GB // 2, 2 * GB, 1.0)
    [advice] = suggestions(over, WorstCase(24, 16, 2, 4), False)
    assert advice.startswith("the process before the preflight") and "3.50 GiB" in advice


def test_adams_state_to_come_is_two_copies_of_each_trainable_weight_without_state():
    model = make_model(95)
    model.lm_head.requires_grad_(False)  # tied to the embedding: frozen too
    trainable = [p for p in model.parameters() if p.requires_grad]
    weights = sum(p.numel() * 4 for p in trainable)
    assert optimizer_state_bytes(model, {}) == 2 * weights
    optimizer = torch.optim.AdamW(trainable)
    model(torch.ones(1, 3, dtype=torch.long)).logits.sum().backward()
    optimizer.step()  # a resumed run's state is in memory already
    assert optimizer_state_bytes(model, optimizer.state) == 0


def test_out_of_gpu_memory_in_the_worst_case_is_the_preflight_stop():
    class OutOfMemory(RecordingEngine):
        def generate(self, model, request) -> Completions:
            torch.rand(3)  # drawn from the RNG before it failed
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    rng = torch.random.get_rng_state()
    with pytest.raises(
        PreflightError, match=r"^Preflight: .* ran out of memory .*train_micro_batch_size.*2.00 GiB"
    ):
        preflight(make_model(95), passes(), Engine(OutOfMemory(), SamplingParams(16), "hf"))
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_longest_prompt_is_the_setting_then_the_data_else_refused():
    assert longest_prompt(64, 10) == 64
    assert longest_prompt(None, 10) == 10
    with pytest.raises(PreflightError, match="^Preflight: the longest prompt is not known.*max_prompt_len"):
        longest_prompt(None, None)


def test_the_data_longest_prompt_is_read_ahead_through_the_encoder():
    from torch.utils.data import DataLoader

    tok = make_tokenizer()
    records = [{"prompt": "a" * n} for n in (3, 17, 5)]

    def encode(prompts):
        return tok(prompts, padding=True, return_tensors="pt")["attention_mask"]

    prompts = training_prompts(DataLoader(records, batch_size=2))
    assert prompts == ["aaa", "a" * 17, "aaaaa"]
    assert data_longest_prompt(prompts, encode, chunk=2) == 17
    assert training_prompts(DataLoader(range(4))) is None  # rows without a prompt


def test_peak_memory_sees_an_allocation_freed_before_the_phase_ends():
    memory = PeakMemory(torch.device("cpu"))
    with memory.phase() as measured:
        block = bytearray(256 * MB)  # touched: resident
        del block
    [phase] = measured
    assert phase.peak - phase.start >= 200 * MB


# -- in a fit ---------------------------------------------------------------------------------


def records(n: int = 4) -> list[dict]:
    return [{"prompt": "ab" * (i + 1)} for i in range(n)]


@pytest.mark.integration
def test_a_fit_over_the_limit_stops_before_its_first_step(tmp_path, module, trainer, loader):
    grpo = module(preflight=True, preflight_memory_gb=0.05, max_new_tokens=64, max_prompt_length=256)
    before = {name: p.detach().clone() for name, p in grpo.model.named_parameters()}
    fit = trainer(tmp_path, max_steps=2)
    with pytest.raises(PreflightError, match=r"^Preflight: .* of 256 prompt \+ 64 new tokens\) peaks at "):
        fit.fit(grpo, loader(records(), batch_size=2))
    assert fit.global_step == 0 and grpo.last_step is None
    assert all(torch.equal(p, before[name]) for name, p in grpo.model.named_parameters())


@pytest.mark.integration
def test_a_fit_reads_the_data_longest_prompt_without_max_prompt_length(tmp_path, module, trainer, loader):
    grpo = module(preflight=True, preflight_memory_gb=0.05)
    with pytest.raises(PreflightError, match=r" of 8 prompt \+ 8 new tokens\)"):
        trainer(tmp_path, max_steps=1).fit(grpo, loader(records(), batch_size=2))


@pytest.mark.integration
def test_a_run_with_preflight_takes_the_same_steps_as_one_without(tmp_path, module, trainer, loader, caplog):
    import lightning.pytorch as pl

    def run(**settings):
        steps = []

        class Records(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                steps.extend(pl_module.batch_records)

        pl.seed_everything(3)  # the HF engine samples: a preflight that drew from the RNG shows
        grpo = module(
            gradient_accumulation_steps=2, train_micro_batch_size=2, max_prompt_length=16, **settings
        )
        with caplog.at_level("INFO"):
            trainer(tmp_path, max_steps=2, callbacks=[Records()]).fit(grpo, loader(records(8), batch_size=2))
        return grpo, steps

    (plain, plain_steps), (checked, checked_steps) = run(), run(preflight=True)
    assert re.search(r"Preflight: the worst case peaks at .* CPU RSS of .* allowed", caplog.text)
    assert len(checked_steps) == len(plain_steps) == 4
    for ours, theirs in zip(checked_steps, plain_steps):
        assert torch.equal(ours.rewards, theirs.rewards) and ours.samples == theirs.samples
        assert torch.equal(ours.completion_lengths, theirs.completion_lengths)
        untimed = {k: v for k, v in theirs.metrics.items() if "perf/" not in k and "time" not in k}
        assert {k: ours.metrics[k] for k in untimed} == untimed
    assert "train/loss" in plain_steps[-1].metrics  # an optimizer step's metrics were compared
    for (name, p), q in zip(plain.model.named_parameters(), checked.model.parameters()):
        assert torch.equal(p, q), name
