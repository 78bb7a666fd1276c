"""IntermediateResultsReward: the share of a worked solution's intermediate results a completion
writes after an "=", and the arithmetic task's worked solutions that feed it."""

import pytest

from forge_lightning.data.arithmetic import generate
from forge_lightning.data.datamodule import PromptDataModule
from forge_lightning.rewards import CompositeReward, GSM8KAnswerReward
from forge_lightning.rewards.extras import RewardState
from forge_lightning.rewards.intermediate import IntermediateResultsReward, intermediate_results, results
from forge_lightning.rewards.library import missing_arguments
from forge_lightning.testing import scripted_rollout

pytestmark = pytest.mark.unit

THREE_STEPS = "10 * 7 = 70\n70 + 56 = 126\n126 - 75 = 51"


def test_results_are_the_numbers_after_an_equals_sign():
    assert results("3 * 4 = 12 apples, then 12 + 1,200.0 = $1,212") == ["12", "1212"]
    assert results("no calculation here: 5 and 7") == []
    assert results("a list = 12,13 and = -4.50") == ["12", "-4.5"]  # numbers read as the answer's are


def test_intermediates_are_every_result_but_the_answer():
    assert intermediate_results(THREE_STEPS) == ["70", "126"]
    assert intermediate_results("82 + 94 = 176") == []
    # GSM8K's answers: the calculator annotations, the answer line after #### not read.
    gsm8k = "She sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72 clips.\n#### 72"
    assert intermediate_results(gsm8k) == ["24"]


def test_the_share_of_the_steps_written():
    reward = IntermediateResultsReward()
    responses = [
        "10 * 7 = 70\n70 + 56 = 126\n126 - 75 = 51\nAnswer: 51",  # every step
        "10 * 7 = 70\n70 + 75 = 145\nAnswer: 145",  # the first step, then astray
        "10 + 7 + 56 = 73\nAnswer: 73",  # no step of the solution
        "Answer: 70 126",  # the numbers, not as results
        "10 * 7 - 75 + 56 = 51\nAnswer: 51",  # right in one expression: no step written
    ]
    out = reward(["p"] * 5, responses, solution=[THREE_STEPS] * 5)
    assert out.scores == [1.0, 0.5, 0.0, 0.0, 0.0]


def test_past_the_steps_pays_nothing_for_stopping_at_one():
    reward = IntermediateResultsReward(past_the_steps=True)
    responses = [
        "10 * 7 = 70\n70 + 56 = 126\nAnswer: 126",  # stopped at the second step
        "10 * 7 = 70\nAnswer: 70",  # stopped at the first
        "10 * 7 = 70\n70 + 56 = 126\n126 - 57 = 69\nAnswer: 69",  # past them, the last step wrong
        "10 * 7 = 70\n70 + 75 = 145\nAnswer: 145",  # astray after the first: its credit kept
    ]
    out = reward(["p"] * 4, responses, solution=[THREE_STEPS] * 4)
    assert out.scores == [0.0, 0.0, 1.0, 0.5]
    assert IntermediateResultsReward()(["p"], responses[:1], solution=[THREE_STEPS]).scores == [1.0]
    with pytest.raises(ValueError, match="past_the_steps must be true or false"):
        IntermediateResultsReward(past_the_steps="yes")


def test_right_takes_all_pays_a_right_answer_whatever_its_steps():
    reward = IntermediateResultsReward(right_takes_all=True)
    responses = [
        "10 * 7 - 75 + 56 = 51\nAnswer: 51",  # right in one expression: no step written
        "56 - 75 + 10 * 7 = 51\nAnswer: 51",  # right, another order
        "10 * 7 = 70\n70 + 75 = 145\nAnswer: 145",  # wrong: the share of the steps, as without it
        "10 * 7 = 70\n70 + 56 = 126\nAnswer: 126",  # stopped at a step: its share too
        "10 + 7 + 56 = 73\nAnswer: 73",
    ]
    out = reward(["p"] * 5, responses, solution=[THREE_STEPS] * 5)
    assert out.scores == [1.0, 1.0, 0.5, 1.0, 0.0]
    gated = IntermediateResultsReward(past_the_steps=True, right_takes_all=True)
    assert gated(["p"] * 5, responses, solution=[THREE_STEPS] * 5).scores == [1.0, 1.0, 0.5, 0.0, 0.0]
    assert IntermediateResultsReward()(["p"], responses[:1], solution=[THREE_STEPS]).scores == [0.0]
    gsm8k = "She sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72 clips.\n#### 72"
    assert reward(["p"], ["48 * 1.5 = 72\nAnswer: 72"], solution=[gsm8k]).scores == [1.0]
    composite = CompositeReward([(GSM8KAnswerReward(), 0.8), (reward, 0.2)])
    out = composite(["p"] * 2, responses[:2], references=["51"] * 2, solution=[THREE_STEPS] * 2)
    assert out.scores == pytest.approx([1.0, 1.0])  # the compound answer no longer 0.8 beside the chain's 1.0
    with pytest.raises(ValueError, match="right_takes_all must be true or false"):
        IntermediateResultsReward(right_takes_all=1)


def test_within_expressions_counts_the_steps_an_expression_computes():
    reward = IntermediateResultsReward(within_expressions=True)
    responses = [
        "10 * 7 + 56 - 57 = 69\nAnswer: 69",  # both steps computed in one expression, the last wrong
        "10 * 7 - 75 + 56 = 51\nAnswer: 51",  # another order: 70 on the way, not 126
        "10 * 7 = 70\n70 + 75 = 145\nAnswer: 145",  # a chain: as without it
        "10 + 7 + 56 = 73\nAnswer: 73",  # no step's quantity
        "10 * 7 + 56 makes 126\nAnswer: 126",  # no "=": no expression read
    ]
    out = reward(["p"] * 5, responses, solution=[THREE_STEPS] * 5)
    assert out.scores == [1.0, 0.5, 0.5, 0.0, 0.0]
    without = IntermediateResultsReward()  # the compound answers' steps, unread
    assert without(["p"] * 2, responses[:2], solution=[THREE_STEPS] * 2).scores == [0.0, 0.0]
    # Stopping at a step in one expression is stopping at it: past_the_steps pays nothing.
    gated = IntermediateResultsReward(past_the_steps=True, within_expressions=True)
    assert gated(["p"], ["10 * 7 + 56 = 126\nAnswer: 126"], solution=[THREE_STEPS]).scores == [0.0]
    products = "22 * 11 = 242\n3 * 21 = 63\n242 + 63 = 305"
    written = ["22 x 11 + 3 * 21 = 300\nAnswer: 300", "22 + 3 = 25\nAnswer: 25"]
    assert reward(["p"] * 2, written, solution=[products] * 2).scores == [1.0, 0.0]
    with pytest.raises(ValueError, match="within_expressions must be true or false"):
        IntermediateResultsReward(within_expressions="on")


def test_fade_steps_scales_the_credit_down_to_nothing_at_that_step():
    reward = IntermediateResultsReward(fade_steps=20)
    responses = ["10 * 7 = 70\n70 + 75 = 145\nAnswer: 145", "10 * 7 - 75 + 56 = 51\nAnswer: 51"]

    def at(step, scored=reward):
        state = RewardState(global_step=step, epoch=0.0, max_steps=60)
        return scored(["p"] * 2, responses, solution=[THREE_STEPS] * 2, trainer_state=state).scores

    assert at(0) == [0.5, 0.0]
    assert at(5) == pytest.approx([0.5 * 0.75, 0.0])
    assert at(20) == at(45) == [0.0, 0.0]
    assert at(5, IntermediateResultsReward(right_takes_all=True, fade_steps=20)) == pytest.approx(
        [0.375, 0.75]
    )
    assert at(5, IntermediateResultsReward()) == [0.5, 0.0]  # no fade: the step is not read
    with pytest.raises(ValueError, match="reads the step from trainer_state"):
        reward(["p"], responses[:1], solution=[THREE_STEPS])
    for wrong in (0, -3, 2.5, True, "10"):
        with pytest.raises(ValueError, match="fade_steps must be a whole number of steps >= 1 or None"):
            IntermediateResultsReward(fade_steps=wrong)


def test_the_scoring_path_gives_the_fading_credit_its_step_inside_a_composite():
    """Every reward call is given trainer_state (the test kit's scoring path: step 0), the parts of
    a CompositeReward too: the credit is paid whole there, not refused."""
    reward = CompositeReward([(GSM8KAnswerReward(), 0.8), (IntermediateResultsReward(fade_steps=10), 0.2)])
    row = {"prompt": "p", "reference": "51", "solution": THREE_STEPS}
    out = scripted_rollout([row], ["10 * 7 = 70\n70 + 75 = 145\nAnswer: 145"], reward=reward)
    assert out.rewards == pytest.approx([0.2 * 0.5])


def test_a_one_step_solution_is_not_scored():
    out = IntermediateResultsReward()(["p"], ["82 + 94 = 176"], solution=["82 + 94 = 176"])
    assert out.scores == [None]


def test_beside_correctness_in_a_composite():
    composite = CompositeReward([(GSM8KAnswerReward(), 0.8), (IntermediateResultsReward(), 0.2)])
    responses = ["10 * 7 = 70\n70 + 75 = 145\nAnswer: 145", "82 + 94 = 176\nAnswer: 176"]
    out = composite(["p", "q"], responses, references=["51", "176"], solution=[THREE_STEPS, "82 + 94 = 176"])
    assert out.scores == pytest.approx([0.2 * 0.5, 0.8])  # a one-step problem: correctness alone


def test_the_solution_column_is_required_and_named():
    reward = IntermediateResultsReward(solution_field="answer")
    assert missing_arguments(reward, {"references"}) == {"IntermediateResultsReward": ["answer"]}
    assert missing_arguments(reward, {"answer"}) == {}
    with pytest.raises(ValueError, match="one 'answer' per response, got none"):
        reward(["p"], ["r"])
    with pytest.raises(ValueError, match="solution_field must be a column's name"):
        IntermediateResultsReward(solution_field="not a name")


def test_the_arithmetic_task_gives_its_workings_when_asked():
    data = PromptDataModule(source="arithmetic", task_variant="multistep_mixed", worked_solutions=True)
    data.setup()
    problems = generate(seed=0, variant="multistep_mixed")
    assert [r["solution"] for r in data._train] == [p.working for p in problems["train"]][: len(data._train)]
    assert [r["solution"] for r in data._val] == [p.working for p in problems["heldout"]][: len(data._val)]
    plain = PromptDataModule(source="arithmetic", task_variant="multistep_mixed")
    plain.setup()
    assert set(plain._train[0]) == {"prompt", "reference"}  # the records as before, unless asked
    assert [{k: r[k] for k in ("prompt", "reference")} for r in data._train] == plain._train


def test_worked_solutions_are_the_arithmetic_tasks_alone():
    with pytest.raises(ValueError, match="worked_solutions gives the arithmetic task's workings"):
        PromptDataModule(source="mock", worked_solutions=True)
