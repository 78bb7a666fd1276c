"""The forms a reward comes in: TRL's list of rewards, TRL-style keyword rewards and dataset columns,
a reward's missing batch key caught before generation, and each component in the samples table and
its curve."""

from __future__ import annotations

import pytest

from forge_lightning.rewards.library import CompositeReward


def test_a_list_of_rewards_is_their_composite_and_anything_else_is_refused_at_once(module):
    def short(prompts, responses):
        return [1.0 / (1 + len(r)) for r in responses]

    def has_a(prompts, responses):
        return [float("a" in r) for r in responses]

    grpo = module(reward=[short, (has_a, 3.0, "a")])
    assert isinstance(grpo.reward, CompositeReward)
    assert grpo.reward.names == ["short", "a"]
    assert "rewards/a" in grpo.train_metrics.means  # each component gets its curve
    with pytest.raises(TypeError, match="reward must be a callable"):
        module(reward="not a function")


def test_trl_style_rewards_get_completions_by_keyword_in_trls_form():
    from forge_lightning.rewards.batch_scoring import score
    from forge_lightning.rewards.library import missing_arguments

    seen = {}

    def completions_only(completions, **kwargs):  # TRL passes everything by keyword
        seen["completions"], seen["kwargs"] = completions, set(kwargs)
        return [1.0] * len(completions)

    def with_answer(prompts, completions, answer):
        seen["prompts"], seen["answer"] = prompts, answer
        return [
            float(a in (c if isinstance(c, str) else c[0]["content"])) for c, a in zip(completions, answer)
        ]

    def text(prompts, responses):
        seen["responses"] = responses
        return [0.5] * len(responses)

    conversation = [{"role": "user", "content": "say 4"}]
    prompts, responses = [conversation, "say 5"], ["4", "6"]
    parts = CompositeReward([(completions_only, 1.0), (with_answer, 1.0), (text, 1.0)])
    scored = score(parts, prompts, responses, answer=["4", "5"])
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}], "6"]
    assert seen["kwargs"] == {"prompts", "answer"}
    assert seen["prompts"] == prompts and seen["answer"] == ["4", "5"]
    assert seen["responses"] == ["4", "6"]  # a (prompts, responses) reward gets the text
    assert scored.components["with_answer"] == [1.0, 0.0]
    # A TRL-style reward's fields are checked before any generation, as every reward's are.
    assert missing_arguments(with_answer, {"prompts"}) == {"with_answer": ["answer"]}
    assert missing_arguments(completions_only, set()) == {}


def test_a_trl_style_reward_gets_the_reference_column_under_its_own_name():
    from forge_lightning.rewards.batch_scoring import score
    from forge_lightning.rewards.library import require_arguments

    seen = {}

    def trl(completions, reference, **kwargs):  # TRL passes dataset columns by their own names
        seen["trl"] = reference
        return [float(c == r) for c, r in zip(completions, reference)]

    def forge(prompts, responses, **kwargs):
        seen["forge"] = set(kwargs)
        return [0.0] * len(responses)

    reward = CompositeReward([(trl, 1.0), (forge, 1.0)])
    require_arguments(reward, {"references"})  # a batch's reference column arrives as references
    scored = score(reward, ["p", "q"], ["4", "6"], references=["4", "5"])
    assert seen["trl"] == ["4", "5"] and scored.components["trl"] == [1.0, 0.0]
    assert seen["forge"] == {"references"}  # a Forge-style reward's arguments are as before


@pytest.mark.integration
def test_a_reward_that_needs_a_key_the_batch_lacks_fails_before_any_generation(
    tmp_path, module, trainer, loader
):
    from forge_lightning.rewards.library import GSM8KAnswerReward

    def by_level(prompts, responses, level):
        return [float(x) for x in level]

    for reward, message in [
        (by_level, r"reward 'by_level' needs level, but a batch gives completion_ids, .*, truncated"),
        ([by_level, GSM8KAnswerReward()], r"'by_level' needs level; 'GSM8KAnswerReward' needs references"),
    ]:
        grpo = module(reward=reward, gradient_accumulation_steps=1, kl_beta=0.0)
        grpo.configure_model()

        def generate(*args, **kwargs):
            raise AssertionError("generated before the check")

        grpo.engine.generate = generate
        with pytest.raises(ValueError, match=message):
            trainer(tmp_path, max_steps=1).fit(grpo, loader([{"prompt": "q"}]))
    # With the key in the data, the same reward trains.
    grpo = module(reward=by_level, gradient_accumulation_steps=1, kl_beta=0.0)
    fit = trainer(tmp_path, max_steps=1)
    fit.fit(grpo, loader([{"prompt": "q", "level": 2}]))
    assert fit.global_step == 1


@pytest.mark.integration
def test_the_samples_table_shows_every_component_of_each_samples_reward(tmp_path, module, trainer, loader):
    from forge_lightning.callbacks.reward_logger import _markdown_table

    def length(prompts, responses):
        return [len(r) / 10 for r in responses]

    def has_a(prompts, responses):
        return [float("a" in r) for r in responses]

    grpo = module(
        reward=[(length, 1.0, "length"), (has_a, 1.0, "a")], gradient_accumulation_steps=1, kl_beta=0.0
    )
    trainer(tmp_path, max_steps=1).fit(grpo, loader([{"prompt": "q"}]))
    record = grpo.last_step
    first = record.sample_components[0]
    assert set(first) == {"length", "a"}
    assert record.samples[0][2] == pytest.approx((first["length"] + first["a"]) / 2)
    table = _markdown_table(record.samples[:2], record.sample_components[:2]).splitlines()
    assert table[0] == "| prompt | completion | reward | length | a |"
    assert table[2].endswith(f"| {first['length']:.3f} | {first['a']:.3f} |")


@pytest.mark.integration
def test_a_component_that_is_not_applicable_stays_out_of_its_curve(tmp_path, module, trainer, loader):
    def even_only(prompts, responses):
        return [1.0 if i % 2 == 0 else None for i in range(len(responses))]

    def zero(prompts, responses):
        return [0.0] * len(responses)

    grpo = module(
        reward=[(even_only, 1.0, "even"), (zero, 1.0, "zero")], gradient_accumulation_steps=1, kl_beta=0.0
    )
    trainer(tmp_path, max_steps=1).fit(grpo, loader([{"prompt": "q"}]))
    metrics = grpo.last_step.metrics
    assert metrics["train/rewards/even"] == 1.0 and metrics["train/rewards/even_std"] == 0.0
    assert metrics["train/reward"] == pytest.approx(0.25)  # (1 + 0) / 2 on half the samples, 0 on the rest
