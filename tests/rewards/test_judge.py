"""JudgeReward: an LLM judge's replies read as scores, through a local OpenAI-compatible endpoint
(tests/conftest.py) and through a local tiny model, scripted and sampled."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.models import make_model, make_tokenizer

from forge_lightning.rewards import JudgeReward, read_score, require_arguments
from forge_lightning.rewards.batch_scoring import score
from forge_lightning.rewards.http import RewardServerError
from forge_lightning.rewards.judge import DEFAULT_TEMPLATE
from forge_lightning.rewards.reward_model import PolicyContext
from forge_lightning.rollout.engines.base import Completions, EngineCapabilities, GenerationRequest
from forge_lightning.rollout.engines.hf import HFGenerate

TEMPLATE = "Q: {prompt}\nA: {completion}\nRight answer: {references}\nScore:"
PROMPTS = ["2 + 3 =", "hi", "7 * 1 ="]
RESPONSES = ["five", "hello", "seven"]
REFERENCES = ["5", "hey", "7"]
# What the judge replies for each completion: a number, a yes and one it cannot read.
REPLIES = {"five": "7", "hello": "yes", "seven": "blah"}


def reply_to(message: str) -> str:
    return REPLIES[re.search(r"A: (\w+)", message).group(1)]


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("7", 7.0),
        ("Score: 7/10", 7.0),
        ("-2.5", -2.5),
        ("yes", 1.0),
        ("Yes.", 1.0),
        ("NO, 3 mistakes", 0.0),
        ("blah", None),
        ("I know", None),
        ("", None),
    ],
)
def test_read_score_reads_a_yes_no_or_the_first_number(reply, expected):
    assert read_score(reply) == expected


def judge_replying(reply: str, template: str) -> JudgeReward:
    """A JudgeReward whose judge replies ``reply`` to every message (no model, no server)."""
    judge = JudgeReward(url="http://127.0.0.1:1/v1", template=template)
    judge._endpoint_replies = lambda texts: [reply] * len(texts)
    return judge


FIVE_POINTS = "Rate the answer on a scale of 1 to 5.\n\n{completion}"
NO_SCALE = "Is this answer right? {completion}"


# Common judge phrasings; None: the reply holds no score (only its scale's numbers, or a number
# outside the template's scale), which is the sample's error, never a 0.
@pytest.mark.parametrize(
    ("template", "reply", "expected"),
    [
        (DEFAULT_TEMPLATE, "On a scale of 0 to 10, I give it 3.", 3.0),
        (DEFAULT_TEMPLATE, "From 1 to 10, I'd rate it a 6.", 6.0),
        (DEFAULT_TEMPLATE, "I give it 5.", 5.0),
        (DEFAULT_TEMPLATE, "7 out of 10", 7.0),
        (DEFAULT_TEMPLATE, "8.5 out of 10", 8.5),
        (DEFAULT_TEMPLATE, "7/10", 7.0),
        (DEFAULT_TEMPLATE, "7 / 10", 7.0),
        (DEFAULT_TEMPLATE, "**7**/10", 7.0),
        (DEFAULT_TEMPLATE, "score: 6", 6.0),
        (DEFAULT_TEMPLATE, "Score: 9/10", 9.0),
        (DEFAULT_TEMPLATE, "**Score:** 8", 8.0),
        (DEFAULT_TEMPLATE, "Rating: 4", 4.0),
        (DEFAULT_TEMPLATE, "It cites 2 sources and is right. Score: 9", 9.0),
        (DEFAULT_TEMPLATE, "Score (0-10): 4", 4.0),
        (DEFAULT_TEMPLATE, "Rating: 3/5", 6.0),  # out of 5, in the template's 0 to 10
        (DEFAULT_TEMPLATE, "10", 10.0),
        (DEFAULT_TEMPLATE, "On a scale of 0 to 10.", None),
        (DEFAULT_TEMPLATE, "12/10", None),
        (DEFAULT_TEMPLATE, "Score: 11", None),
        (FIVE_POINTS, "4", 4.0),
        (FIVE_POINTS, "8 out of 10", 4.0),
        (FIVE_POINTS, "7", None),
        (NO_SCALE, "Score: 7/10", 7.0),
        (NO_SCALE, "15", 15.0),
        (NO_SCALE, "yes", 1.0),
    ],
)
def test_a_judges_common_phrasings_are_read_in_the_templates_scale(template, reply, expected):
    judge = judge_replying(reply, template)
    if expected is not None:
        assert score(judge, ["q"], ["a"], on_error="zero") == score(judge, ["q"], ["a"])
        assert score(judge, ["q"], ["a"]).total == [expected]
        return
    with pytest.warns(
        UserWarning, match=rf"could not score 1 of 1 samples.*replied {re.escape(repr(reply))}"
    ):
        scored = score(judge, ["q"], ["a"], on_error="zero")
    assert scored.total == [0.0] and scored.num_errors == 1  # counted in reward_errors


def openai_judge(serve):
    """A local OpenAI-compatible chat endpoint replying as REPLIES says."""

    async def chat(body, n):
        return {
            "choices": [
                {"message": {"role": "assistant", "content": reply_to(body["messages"][-1]["content"])}}
            ]
        }

    return serve(chat, path="/v1/chat/completions")


def test_an_endpoint_judge_gives_the_number_the_yes_and_counts_the_unreadable_reply(serve):
    server = openai_judge(serve)
    judge = JudgeReward(model="judge-7b", url=server.url.removesuffix("/chat/completions"), template=TEMPLATE)
    with pytest.warns(
        UserWarning, match=r"could not score 1 of 3 samples.*sample 2: its judge replied 'blah'"
    ):
        scored = score(judge, PROMPTS, RESPONSES, on_error="zero", references=REFERENCES)
    assert scored.total == [7.0, 1.0, 0.0] and scored.num_errors == 1
    first = server.requests[0]
    assert first["model"] == "judge-7b" and first["temperature"] == 0.0
    assert first["messages"] == [{"role": "user", "content": "Q: 2 + 3 =\nA: five\nRight answer: 5\nScore:"}]

    with pytest.raises(
        RuntimeError, match=r"'JudgeReward' could not score sample 2: its judge replied 'blah'"
    ):
        score(judge, PROMPTS, RESPONSES, on_error="raise", references=REFERENCES)


def test_an_endpoint_that_answers_no_chat_completion_is_named(serve):
    async def odd(body, n):
        return {"result": "7"}

    server = serve(odd, path="/v1/chat/completions")
    judge = JudgeReward(url=server.url, template="{completion}", retries=0)
    with pytest.raises(RewardServerError, match=rf"POST {server.url} answered .*not a chat completion"):
        judge(["p"], ["a"])
    assert "model" not in server.requests[0]  # none given: the server's one model


class ScriptedJudge:
    """An engine replying to each rendered judge message as REPLIES says, recording its batches."""

    def __init__(self, tokenizer) -> None:
        self.tok, self.batches = tokenizer, []

    capabilities = EngineCapabilities()

    def generate(self, model, request: GenerationRequest) -> Completions:
        texts = [
            self.tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True)
            for ids, mask in zip(request.prompt_ids.tolist(), request.prompt_mask.tolist())
        ]
        self.batches.append(texts)
        rows = [
            self.tok(reply_to(t), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            for t in texts
        ]
        width = max(map(len, rows))
        return Completions(torch.tensor([r + [self.tok.eos_token_id] * (width - len(r)) for r in rows]))


def test_a_local_judge_gives_the_number_the_yes_and_counts_the_unreadable_reply():
    tok = make_tokenizer(chat_template=True)
    judge = JudgeReward(make_model(len(tok)), tokenizer=tok, template=TEMPLATE, batch_size=2)
    judge.engine = ScriptedJudge(tok)
    with pytest.warns(UserWarning, match=r"could not score 1 of 3 samples.*'blah'"):
        scored = score(judge, PROMPTS, RESPONSES, on_error="zero", references=REFERENCES)
    assert scored.total == [7.0, 1.0, 0.0] and scored.num_errors == 1
    # Batched by batch_size, each message through the judge's chat template as the user's turn.
    assert [len(batch) for batch in judge.engine.batches] == [2, 1]
    assert judge.engine.batches[0][0] == "<user>Q: 2 + 3 =\nA: five\nRight answer: 5\nScore:\n<assistant>"


def test_a_local_judges_replies_are_its_greedy_generation_without_grad_on_the_policys_device(
    tiny_model_dir,
):
    judge = JudgeReward(str(tiny_model_dir), template="Rate: {completion}", max_new_tokens=4, batch_size=2)
    judge.use_policy_context(PolicyContext(torch.device("cpu")))
    output = judge(["p"] * 3, ["a", "bb", "ccc"])
    model, tok = judge.generator, judge._tokenizer
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    for completion, reply in zip(["a", "bb", "ccc"], output.metadata["replies"]):
        ids = tok(f"Rate: {completion}", return_tensors="pt")["input_ids"]
        with torch.no_grad():
            greedy = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        want = greedy[0, ids.shape[1] :].tolist()
        if tok.eos_token_id in want:
            want = want[: want.index(tok.eos_token_id)]
        assert reply == tok.decode(want, skip_special_tokens=True)
    read = [read_score(r) for r in output.metadata["replies"]]
    assert output.scores == [0.0 if r is None else r for r in read]
    assert sorted(output.metadata["unscored"]) == [i for i, r in enumerate(read) if r is None]
    assert isinstance(judge.engine, HFGenerate)


def test_a_completion_is_inserted_as_text_never_read_as_a_template(serve):
    server = openai_judge(serve)
    judge = JudgeReward(url=server.url, template="Q: {prompt}\nA: {completion}")
    REPLIES["x"] = "3"
    try:
        judge(["{completion.__class__}"], ["x {prompt} {0} {"])
    finally:
        del REPLIES["x"]
    assert server.requests[0]["messages"][0]["content"] == "Q: {completion.__class__}\nA: x {prompt} {0} {"


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("Rate {prompt}", "must name {completion}"),
        ("{completion.__class__}", "are not names"),
        ("{completion} {", "not a format string"),
    ],
)
def test_a_bad_template_is_refused_by_name(template, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        JudgeReward(url="http://127.0.0.1:1/v1", template=template)


def test_a_field_the_template_names_is_required_of_the_batch_before_any_generation():
    judge = JudgeReward(url="http://127.0.0.1:1/v1", template=TEMPLATE)
    require_arguments(judge, {"references"})
    with pytest.raises(ValueError, match=r"'JudgeReward' needs references"):
        require_arguments(judge, {"tag"})


def test_a_judge_needs_a_model_or_a_url():
    with pytest.raises(ValueError, match=r"JudgeReward needs a judge: model= .* or url="):
        JudgeReward(template="{completion}")


def test_a_local_judge_folder_that_changed_is_refused_on_resume(tmp_path):
    from forge_lightning.rewards.reward_model import check_reward_models, reward_model_fingerprints

    tok, folder = make_tokenizer(), tmp_path / "judge"
    make_model(len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    saved = reward_model_fingerprints([JudgeReward(str(folder), template="{completion}")])
    assert saved[0]["folder"] == str(folder) and saved[0]["fingerprint"]
    check_reward_models(saved, [JudgeReward(str(folder), template="{completion}")])  # the same judge
    make_model(len(tok), seed=1).save_pretrained(folder)
    with pytest.raises(RuntimeError, match=rf"in {folder} is not the one .*its weights changed"):
        check_reward_models(saved, [JudgeReward(str(folder), template="{completion}")])
    assert reward_model_fingerprints([JudgeReward(url="http://h:1/v1", template="{completion}")]) == []
