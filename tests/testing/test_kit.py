"""The test kit (forge_lightning/testing/): scripted completions go through the package's own tool
loop and reward scoring, and README's example test runs as README shows it."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

from forge_lightning.rollout.tools import CALL_FORMATS
from forge_lightning.testing import scripted_rollout, tiny_model, tiny_policy, tiny_tokenizer

README = Path(__file__).resolve().parents[2] / "README.md"
CALLS: list[dict] = []


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    CALLS.append({"a": a, "b": b})
    return a + b


def explode(x: int) -> int:
    """Always fails.

    Args:
        x: anything.
    """
    raise RuntimeError("boom")


class Counter:
    """An environment: a counter that starts where the row says and scores where it ends."""

    def reset(self, start: int = 0) -> str:
        self.total = start
        return f"The counter is at {start}."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much.
        """
        self.total += by
        return self.total

    def get_reward(self) -> float:
        return float(self.total)


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_a_reward_sees_the_scripted_completions_and_the_rows_fields():
    seen = {}

    def reward(prompts, responses, references, completion_lengths, **kwargs):
        seen.update(prompts=prompts, responses=responses, references=references, lengths=completion_lengths)
        return [float(r == ref) for r, ref in zip(responses, references)]

    records = [{"prompt": "2+3?", "reference": "5"}, {"prompt": "1+1?", "reference": "2"}]
    out = scripted_rollout(records, {"2+3?": ["5", "six"], "1+1?": ["3", "2"]}, reward=reward)

    assert seen == {
        "prompts": ["2+3?", "2+3?", "1+1?", "1+1?"],
        "responses": ["5", "six", "3", "2"],
        "references": ["5", "5", "2", "2"],
        "lengths": [2, 4, 2, 2],  # the text's bytes and the end-of-turn token
    }
    assert out.rewards == [1.0, 0.0, 0.0, 1.0]
    assert [s.reward for s in out] == out.rewards and out[1].components == {"reward": 0.0}


def test_a_call_in_the_script_runs_the_tool_and_the_model_reads_its_result():
    CALLS.clear()
    out = scripted_rollout(["What is 2+3?"], [[call("add", a=2, b=3), "It is 5."], "I guess 6."], tools=[add])

    assert CALLS == [{"a": 2, "b": 3}]
    first = out[0]
    assert first.tool_calls == [
        {"name": "add", "arguments": {"a": 2, "b": 3}, "result": "5", "ok": True, "truncated": False}
    ]
    assert first.tool_text == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert first.sampled == call("add", a=2, b=3) + "<|im_end|>It is 5.<|im_end|>"  # it ended its turn
    assert first.transcript == call("add", a=2, b=3) + "<|im_end|>" + first.tool_text + "It is 5.<|im_end|>"
    assert first.messages[1] == {"role": "tool", "name": "add", "content": "5"}
    assert out[1].tool_calls == [] and out[1].completion == "I guess 6."
    # The loss weighs the policy's tokens only: the tool's answer is in the completion, not the loss.
    mask = out.rollout.loss_mask()[0]
    assert int(mask.sum()) == len(first.sampled.replace("<|im_end|>", "")) + 2


@pytest.mark.parametrize("call_format", ["hermes", "llama3_json", "qwen3_coder"])
def test_every_call_of_a_scripted_turn_runs(call_format):
    fmt = CALL_FORMATS[call_format]()
    calls = fmt.write("add", {"a": 2, "b": 3}), fmt.write("add", {"a": 4, "b": 5})
    turn = "; ".join(calls) if call_format == "llama3_json" else "".join(calls)
    CALLS.clear()
    out = scripted_rollout(["Q"], [[turn, "5 and 9."]], tools=[add], call_format=call_format)
    assert sorted(CALLS, key=str) == [{"a": 2, "b": 3}, {"a": 4, "b": 5}]
    assert [c["result"] for c in out[0].tool_calls] == ["5", "9"]
    assert [m["role"] for m in out[0].messages] == ["assistant", "tool", "tool", "assistant"]


def test_each_completion_follows_its_own_script_after_the_same_call():
    same = call("add", a=1, b=1)
    # The second starts as the calls do, and the third's input is the first's.
    script = [[same, "two"], "<b>none</b>", [same, "deux"], [call("add", a=1, b=2), "three"]]
    out = scripted_rollout(["Q", "Q"], script, tools=[add])
    assert [s.messages[-1]["content"] for s in out] == ["two", "<b>none</b>", "deux", "three"] * 2
    assert out.rollout.tool_stats["turns"].tolist() == [2, 1, 2, 2] * 2


def test_a_tool_that_raises_answers_with_the_error_the_model_reads():
    out = scripted_rollout(["Q"], [[call("explode", x=1), "sorry"]], tools=[add, explode])
    entry = out[0].tool_calls[0]
    assert entry["ok"] is False and entry["result"].startswith("error: explode raised RuntimeError: boom")
    assert entry["result"] in out[0].tool_text
    assert out.rollout.tool_stats["tool_errors"].tolist() == [1]


def test_an_environment_per_completion_is_reset_with_its_row_and_scores_it():
    script = [[call("increment", by=2), call("increment", by=2), "done"], "nothing"]
    out = scripted_rollout([{"prompt": "Count", "start": 10}], script, environment_factory=Counter)

    assert out.rewards == [14.0, 10.0]  # get_reward is the reward where none is given
    assert [c["result"] for c in out[0].tool_calls] == ["12", "14"]
    assert out[0].environment is not out[1].environment
    prompt = tiny_tokenizer().decode(out.rollout.prompt_ids[0][out.rollout.prompt_mask[0].bool()])
    assert "The counter is at 10." in prompt and '"name": "increment"' in prompt


def test_an_environments_score_joins_the_reward_set_equally_weighted():
    def finished(prompts, responses):
        return [float(r.endswith("done")) for r in responses]

    script = [[call("increment", by=2), "done"], "nothing"]
    out = scripted_rollout(
        [{"prompt": "Count", "start": 1}], script, environment_factory=Counter, reward=finished
    )
    assert out[0].components == {"finished": 1.0, "EnvironmentReward": 3.0}
    assert out.rewards == [2.0, 0.5]  # (1 + 3) / 2 and (0 + 1) / 2


def test_rewards_come_back_as_the_reward_returned_them():
    def tenths(prompts, responses):
        return [0.2, 0.1]

    out = scripted_rollout(["Q"], ["a", "b"], reward=[tenths, tenths])
    assert out.rewards == [0.2, 0.1] and out[0].reward == 0.2  # not float32's 0.20000000298
    assert out[1].components == {"tenths": 0.1, "tenths_2": 0.1}
    assert all(type(r) is float for r in out.rewards)


def test_a_list_of_rewards_is_scored_by_component_and_a_trl_style_one_gets_the_messages():
    def used_a_tool(prompts, completions, **kwargs):
        return [float(isinstance(c, list) and c[1]["role"] == "tool") for c in completions]

    def short(prompts, responses):
        return [float(len(r) < 20) for r in responses]

    out = scripted_rollout(
        ["Q"], [[call("add", a=1, b=2), "3"], "3"], tools=[add], reward=[used_a_tool, short]
    )
    assert out[0].components == {"used_a_tool": 1.0, "short": 0.0}
    assert out[1].components == {"used_a_tool": 0.0, "short": 1.0}
    assert out.rewards == [0.5, 0.5]


def test_without_a_reward_nothing_is_scored():
    out = scripted_rollout(["Q"], ["a", "b"])
    assert out.rewards is None and out[0].reward is None and out[0].messages[-1]["content"] == "a"


def test_a_reward_that_raises_is_counted_under_zero_and_named_under_raise():
    def picky(prompts, responses):
        if any("bad" in r for r in responses):
            raise ValueError("cannot score")
        return [1.0] * len(responses)

    with pytest.warns(UserWarning, match="raised on 1 of 2 samples"):
        out = scripted_rollout(["Q"], ["good", "bad"], reward=picky, on_reward_error="zero")
    assert out.rewards == [1.0, 0.0] and out.reward_errors == 1
    with pytest.raises(RuntimeError, match="reward 'picky' failed on sample 1"):
        scripted_rollout(["Q"], ["good", "bad"], reward=picky)


def test_a_script_that_ends_on_a_call_is_refused_by_name():
    with pytest.raises(ValueError, match="completion 1 of prompt 0 called a tool in its last scripted turn"):
        scripted_rollout(["Q"], ["fine", call("add", a=1, b=2)], tools=[add])


def test_the_tiny_policy_is_seeded_and_encodes_any_text():
    policy = tiny_policy()
    text = "20°C <|im_end|> {ok}"
    ids = policy.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert policy.tokenizer.decode(ids) == text and policy.tokenizer.eos_token_id == 1
    assert policy.model.config.vocab_size == len(policy.tokenizer) == 259
    same = tiny_model(len(policy.tokenizer), max_position_embeddings=4096)
    assert all(torch.equal(a, b) for a, b in zip(policy.model.parameters(), same.parameters()))


def test_the_kit_imports_without_pytest_which_only_its_fixtures_need(monkeypatch):
    for name in [m for m in sys.modules if m.startswith("forge_lightning.testing")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pytest", None)  # makes an import of it fail
    kit = importlib.import_module("forge_lightning.testing")
    assert callable(kit.scripted_rollout)
    with pytest.raises(ImportError):
        importlib.import_module("forge_lightning.testing.fixtures")


def readme_example() -> str:
    section = README.read_text().split("\n## Testing your rewards and tools\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_test_passes_with_the_kits_fixtures(tmp_path, monkeypatch):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["forge_lightning.testing.fixtures"]\n')
    (tmp_path / "test_example.py").write_text(readme_example())

    class Outcomes:
        def __init__(self) -> None:
            self.reports = []

        def pytest_runtest_logreport(self, report) -> None:
            if report.when == "call" or report.outcome != "passed":
                self.reports.append((report.nodeid, report.outcome))

    outcomes = Outcomes()
    args = [
        str(tmp_path),
        "-q",
        "-p",
        "no:cacheprovider",
        "--import-mode=importlib",
        "--rootdir",
        str(tmp_path),
    ]
    # The inner session imports its own conftest.py: the suite's ``conftest`` module (whose fixtures
    # the tests use) and sys.path are put back after it (monkeypatch's undo).
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("conftest", "test_example"):
        if name in sys.modules:
            monkeypatch.setitem(sys.modules, name, sys.modules[name])
        else:
            monkeypatch.delitem(sys.modules, name, raising=False)
    code = pytest.main(args, plugins=[outcomes])
    assert code == 0, outcomes.reports
    assert outcomes.reports and all(outcome == "passed" for _, outcome in outcomes.reports)
