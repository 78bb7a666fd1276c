"""Sampled evaluation: pass@k and maj@k against every subset, a scripted policy's exact metrics,
the answers file, and a fit that trains the same with or without it."""

from __future__ import annotations

import itertools
import json
import os
import random
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.engines import ScriptedAnswers
from helpers.models import make_model, make_tokenizer
from helpers.rewards import varied

from forge_lightning.callbacks import RewardLogger
from forge_lightning.evaluation.sampled import majority_at, pass_at_k, prompt_metrics, report_ks
from forge_lightning.rollout.engines.base import EngineCapabilities, SamplingParams


def brute_pass(right: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(right, k))
    return sum(any(s) for s in subsets) / len(subsets)


def brute_majority(keys: list, right: list[bool], k: int) -> float:
    """The vote of every k-subset, by the documented rule: the most frequent key, ties to the one
    seen first among all the samples, None never winning."""
    first = {key: keys.index(key) for key in keys}
    key_right = {key: right[first[key]] for key in keys}
    wins = 0
    for subset in itertools.combinations(range(len(keys)), k):
        votes = Counter(keys[i] for i in subset if keys[i] is not None)
        if votes:
            top = max(votes.values())
            winner = min((key for key, v in votes.items() if v == top), key=first.__getitem__)
            wins += key_right[winner]
    return wins / len(list(itertools.combinations(range(len(keys)), k)))


def test_report_ks_are_the_powers_of_two_up_to_n_and_n():
    assert report_ks(1) == [1]
    assert report_ks(8) == [1, 2, 4, 8]
    assert report_ks(6) == [1, 2, 4, 6]


def test_pass_at_k_equals_the_share_of_subsets_holding_a_right_sample():
    for n in range(1, 8):
        for c in range(n + 1):
            right = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass(right, k), abs=1e-12)
    # The product form holds where the binomials would not fit a float: C(2000, 1000) ~ 1e600.
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)


def test_majority_equals_the_vote_of_every_subset():
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 8)
        keys = [rng.choice(["1", "2", "3", None]) for _ in range(n)]
        right = [key == "2" for key in keys]
        ks = list(range(1, n + 1))
        expected = [brute_majority(keys, right, k) for k in ks]
        assert majority_at(keys, right, ks) == pytest.approx(expected, abs=1e-12)


def test_majority_on_a_table_with_ties_goes_to_the_key_seen_first():
    keys, right = ["7", "5", "5", "7", None], [True, False, False, True, False]
    # k=2: of the 10 pairs, 5 beats 7 only in (1, 2), (1, 4), (2, 4); a 5-7 tie goes to 7 (index 0).
    assert majority_at(keys, right, [1, 2, 5]) == pytest.approx([0.4, 0.7, 1.0])
    # The wrong key seen first wins the plain vote's tie.
    assert majority_at(["5", "7", "7", "5"], [False, True, True, False], [4]) == [0.0]
    assert majority_at([None, None, "3"], [False, False, True], [1, 2, 3]) == pytest.approx(
        [1 / 3, 2 / 3, 1.0]
    )


def test_pass_at_1_is_mean_at_n():
    rng = random.Random(1)
    for _ in range(20):
        scores = [float(rng.random() < 0.4) for _ in range(rng.randint(1, 9))]
        values = prompt_metrics(scores, None, [1])
        assert values["pass@1"] == pytest.approx(values[f"mean@{len(scores)}"])


# Each prompt's scripted answers: the greedy completion is the first, the n=4 samples all four.
SCRIPT = {
    "a": ["1", "1", "1", "1"],  # reference 1: all right
    "b": ["2", "3", "3", "x"],  # reference 3: two right, one with no answer
    "c": ["9", "8", "9", "9"],  # reference 1: none right
}
RECORDS = [{"prompt": p, "reference": r} for p, r in [("a", "1"), ("b", "3"), ("c", "1")]]
EXPECTED = {
    "val/mean@4": 0.5,
    "val/pass@1": 0.5,
    "val/pass@2": (1 + 5 / 6) / 3,  # b: 1 - C(2,2)/C(4,2)
    "val/pass@4": 2 / 3,
    "val/maj@1": 0.5,  # b: two of its four samples say 3
    "val/maj@2": 0.5,  # b: (3, 3), (3, x) twice right; (2, 3) ties to 2, seen first
    "val/maj@4": 2 / 3,
    "val/frac_all_correct": 1 / 3,
    "val/frac_none_correct": 1 / 3,
    "val/sampled_completion_length": 2.0,  # one character and EOS
    "val/sampled_truncated_fraction": 0.0,
}


def scripted_validate(module, trainer, loader, root: Path, **settings):
    grpo = module(val_num_generations=4, val_temperature=0.7, val_top_p=0.9, val_max_new_tokens=3, **settings)
    grpo.engine = ScriptedAnswers(grpo.tokenizer, SCRIPT)
    (results,) = trainer(root, callbacks=[RewardLogger()]).validate(grpo, loader(RECORDS, batch_size=2))
    (answers,) = (root / "validation").iterdir()
    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    return grpo, {k: float(v) for k, v in results.items()}, rows


@pytest.mark.integration
def test_a_scripted_policy_gives_exact_sampled_metrics(module, trainer, loader, tmp_path):
    grpo, metrics, _ = scripted_validate(module, trainer, loader, tmp_path)
    assert {k: metrics[k] for k in EXPECTED} == pytest.approx(EXPECTED)
    assert metrics["val/accuracy"] == pytest.approx(1 / 3)  # the greedy answers: 1, 2, 9
    assert metrics["val/pass@1"] == metrics["val/mean@4"]
    sampled = [p for p in grpo.engine.params if not p.greedy]
    assert sampled == [SamplingParams(3, temperature=0.7, top_p=0.9)] * 2  # one call per batch
    assert {p.max_new_tokens for p in grpo.engine.params if p.greedy} == {3}  # greedy's too


@pytest.mark.integration
def test_without_an_answer_key_no_maj_at_k_is_logged(module, trainer, loader, tmp_path):
    _, metrics, rows = scripted_validate(module, trainer, loader, tmp_path, answer_key=None)
    assert not any(k.startswith("val/maj@") for k in metrics) and "val/pass@4" in metrics
    assert "key" not in rows[0]["samples"][0]


@pytest.mark.integration
def test_logged_values_are_those_of_the_answers_file(module, trainer, loader, tmp_path):
    _, metrics, rows = scripted_validate(module, trainer, loader, tmp_path)
    assert [r["prompt"] for r in rows] == ["a", "b", "c"]
    assert rows[1]["samples"] == [
        {
            "completion": text,
            "key": key,
            "correct": float(key == "3"),
            "completion_length": 2,
            "truncated": False,
        }
        for text, key in zip(SCRIPT["b"], ["2", "3", "3", None])
    ]
    per_prompt = [
        prompt_metrics([s["correct"] for s in r["samples"]], [s["key"] for s in r["samples"]], [1, 2, 4])
        for r in rows
    ]
    for name in per_prompt[0]:
        assert metrics[f"val/{name}"] == pytest.approx(sum(p[name] for p in per_prompt) / len(rows))
    samples = [s for r in rows for s in r["samples"]]
    assert metrics["val/sampled_completion_length"] == pytest.approx(
        sum(s["completion_length"] for s in samples) / len(samples)
    )


@pytest.mark.integration
def test_sampled_answers_depend_on_the_seed_not_on_the_global_rng(module, trainer, loader, tmp_path):
    """The samples are drawn under their own seeded RNG: two validations of the same weights
    sample the same, whatever the global RNG holds, and leave it as it was."""
    records = [{"prompt": "1 + 2 =", "reference": "3"}]
    grpo = module(val_num_generations=3, max_new_tokens=6)
    files = []
    for i, global_seed in enumerate([1, 2]):
        torch.manual_seed(global_seed)
        root = tmp_path / str(i)
        trainer(root, callbacks=[RewardLogger()]).validate(grpo, loader(records))
        (path,) = (root / "validation").iterdir()
        files.append([s["completion"] for s in json.loads(path.read_text())["samples"]])
    assert files[0] == files[1] and len(set(files[0])) > 1  # sampled, not greedy


class StepLog(pl.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        metrics = pl_module.last_step.metrics
        self.steps.append({k: metrics[k] for k in ("train/loss", "train/reward", "train/grad_norm")})


@pytest.mark.integration
def test_a_fit_trains_the_same_with_or_without_sampled_validations(trainer, loader, tmp_path):
    """Training samples with HF generate from the global RNG: validating between its steps, greedy
    or sampled, must leave that RNG as it was (Lightning's validation loader draws from it too)."""
    from forge_lightning.module import GRPOLightningModule

    records = [{"prompt": f"q{i}", "reference": "1"} for i in range(4)]

    def fit(validate: bool) -> list[dict[str, float]]:
        pl.seed_everything(3)
        tok = make_tokenizer()
        grpo = GRPOLightningModule(
            model=make_model(len(tok)),
            tokenizer=tok,
            reward=varied,
            group_size=2,
            max_new_tokens=4,
            learning_rate=1e-3,
            gradient_accumulation_steps=1,
            kl_beta=0.0,
            loss_type="dapo",  # a nonzero loss from the first pass
            val_num_generations=4 if validate else 0,
        )
        log = StepLog()
        every = dict(val_check_interval=1, limit_val_batches=1) if validate else dict(limit_val_batches=0)
        run = trainer(tmp_path / str(validate), max_steps=4, max_epochs=-1, callbacks=[log], **every)
        run.fit(grpo, loader(records, batch_size=2), loader(records, batch_size=2) if validate else None)
        if validate:
            assert "val/pass@4" in run.callback_metrics
        return log.steps

    without, with_validation = fit(False), fit(True)
    assert len(without) == 4 and with_validation == without


@pytest.mark.integration
def test_a_reference_the_accuracy_check_cannot_read_names_the_accuracy_setting(
    module, trainer, loader, tmp_path
):
    records = [{"prompt": "what says meow?", "reference": "cat"}]
    with pytest.raises(
        RuntimeError, match=r"`accuracy` setting.*accuracy=ExactMatchReward\(\).*--model\.accuracy"
    ):
        trainer(tmp_path).validate(module(), loader(records))


def test_the_sampled_evaluation_settings_may_change_on_resume():
    from forge_lightning.run.resume import resume_differences
    from forge_lightning.settings.groups import CHANGEABLE_ON_RESUME

    saved = {"val_num_generations": 0, "val_temperature": 1.0, "val_top_p": 1.0, "val_max_new_tokens": None}
    now = {"val_num_generations": 8, "val_temperature": 0.6, "val_top_p": 0.95, "val_max_new_tokens": 64}
    fixed, changeable = resume_differences(saved, now, CHANGEABLE_ON_RESUME)
    assert fixed == [] and len(changeable) == 4


@pytest.mark.integration
def test_with_tools_the_samples_run_the_tool_loop_and_keep_their_calls(module, trainer, loader, tmp_path):
    from helpers.engines import CalculatorCalls

    grpo = module(calculator="annotation", val_num_generations=3, max_new_tokens=12)
    grpo.engine = CalculatorCalls(grpo.tokenizer)
    trainer(tmp_path, callbacks=[RewardLogger()]).validate(grpo, loader([{"prompt": "ab", "reference": "3"}]))
    (path,) = (tmp_path / "validation").iterdir()
    samples = json.loads(path.read_text())["samples"]
    # Sample j of the group calls the calculator j times (CalculatorCalls), each call answered.
    assert [len(s["tool_calls"]) for s in samples] == [0, 1, 1]
    assert samples[1]["completion"].startswith("#1<<1+0=1>>")


@pytest.mark.integration
def test_under_ddp_each_prompt_counts_once_and_rank_0_writes_every_answer(tmp_path):
    """Five prompts on two ranks: the sampler repeats one for the second rank, which samples it
    (as a sharded policy's ranks must) and counts it nowhere."""
    import subprocess
    import sys

    from helpers.ddp_validation import validate

    tests = Path(__file__).resolve().parents[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run(
        [*torchrun, str(tests / "helpers" / "ddp_validation.py"), str(tmp_path / "ddp")],
        capture_output=True,
        text=True,
        timeout=300,
        # the checkout under test, not an installed copy of the package
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    one = validate(tmp_path / "one", devices=1)
    ddp = json.loads((tmp_path / "ddp" / "metrics.json").read_text())
    assert ddp == pytest.approx(one) and ddp["val/frac_all_correct"] == pytest.approx(1 / 5)

    def answers(root: Path) -> list[dict]:
        (path,) = (root / "validation").iterdir()
        return [json.loads(line) for line in path.read_text().splitlines()]

    assert [a["prompt"] for a in answers(tmp_path / "ddp")] == list("abcde")
    assert answers(tmp_path / "ddp") == answers(tmp_path / "one")


@pytest.mark.integration
def test_validations_inside_one_accumulated_step_evaluate_its_weights_into_files_of_their_own(
    module, trainer, loader, tmp_path
):
    """val_check_interval counts batches: with two batches a step, a validation after every batch
    lands mid-step every other time and evaluates the last finished step's weights again."""
    records = [{"prompt": f"q{i}", "reference": "1"} for i in range(4)]
    grpo = module(gradient_accumulation_steps=2, group_size=2, max_new_tokens=4, val_num_generations=2)
    run = trainer(
        tmp_path, max_steps=2, val_check_interval=1, num_sanity_val_steps=0, callbacks=[RewardLogger()]
    )
    run.fit(grpo, loader(records), loader(records[:2], batch_size=2))
    files = {p.name: p.read_text() for p in (tmp_path / "validation").iterdir()}
    assert sorted(files) == ["step-0.jsonl", "step-1-2.jsonl", "step-1.jsonl", "step-2.jsonl"]
    assert files["step-1-2.jsonl"] == files["step-1.jsonl"]  # the same weights, the same seeds


class CountingGenerate:
    """An engine that fails the test if asked to sample: the budget check comes before any step."""

    def __init__(self) -> None:
        self.calls = 0

    capabilities = EngineCapabilities()

    def generate(self, model, request):
        self.calls += 1
        raise AssertionError("sampled before the budget check")


@pytest.mark.integration
def test_a_sampled_evaluation_over_the_generation_budget_is_refused_before_any_step(
    module, trainer, tmp_path
):
    # 200000 samples x 8 prompts x 8 tokens would allocate tens of GB at the first validation,
    # after the first training steps; the budget check refuses it when the fit starts.
    from forge_lightning.data import PromptDataModule

    grpo = module(val_num_generations=200_000, max_new_tokens=8)
    grpo.engine = CountingGenerate()
    data = PromptDataModule(source="arithmetic", max_samples=4, val_max_samples=8, prompts_per_step=2)
    rule = (
        r"val_num_generations=200000 x data.val_batch_size=8 rows x \(0 prompt \+ 8 new tokens\) = "
        r"12,800,000 tokens in one batch's generation, over max_generation_tokens=1,048,576"
    )
    with pytest.raises(ValueError, match=rule) as refused:
        trainer(tmp_path, max_steps=1).fit(grpo, datamodule=data)
    assert "at most 16384 here" in str(refused.value) and grpo.engine.calls == 0
    # The same refusal for validate, before its first batch is sampled.
    with pytest.raises(ValueError, match=rule):
        trainer(tmp_path).validate(grpo, datamodule=data)
    assert grpo.engine.calls == 0


def test_the_generation_budget_counts_rows_times_prompt_and_new_tokens():
    from forge_lightning.settings.groups import GRPOSettings, check_generation_budget

    hp = {
        "val_num_generations": 16,
        "val_max_new_tokens": None,
        "max_new_tokens": 16,
        "group_size": 8,
        "max_prompt_length": 48,
        "max_generation_tokens": 16 * 4 * 64,
    }
    settings = GRPOSettings.from_hparams(hp)
    check_generation_budget(settings, train_prompts=8, val_prompts=4)  # both exactly at the budget
    check_generation_budget(settings, train_prompts=None, val_prompts=None)  # not known yet
    with pytest.raises(ValueError, match=r"^val_num_generations=16 x data.val_batch_size=5 rows"):
        check_generation_budget(settings, train_prompts=8, val_prompts=5)
    with pytest.raises(ValueError, match=r"^group_size=8 x data.prompts_per_step=9 rows .*at most 7 here"):
        check_generation_budget(settings, train_prompts=9, val_prompts=1)
    roomy = GRPOSettings.from_hparams({**hp, "max_generation_tokens": 10**9})
    check_generation_budget(roomy, train_prompts=9, val_prompts=5)
