"""SettledPromptFilter (first named DifficultyCurriculum): which prompts it drops, and its history
through a checkpoint's state."""

from __future__ import annotations

import hashlib
import importlib
import io
from types import SimpleNamespace

import pytest
import torch

from forge_lightning.callbacks.settled_prompt_filter import SettledPromptFilter, prompt_keys
from forge_lightning.rollout.sources import TrainingBatch

ONE_RANK = SimpleNamespace(world_size=1)
PROMPTS = ["easy", "hard", "mixed"]


def visit(curriculum: SettledPromptFilter, rewards: list[float], prompts=PROMPTS, **rows) -> list[bool]:
    """One batch of ``prompts`` (G = 2) with these rewards: the prompts the curriculum keeps."""
    batch = TrainingBatch(list(prompts), rows, 0)
    return curriculum.on_rewards_end(ONE_RANK, None, torch.tensor(rewards), batch).tolist()


def test_prompts_always_or_never_solved_over_the_window_are_dropped_until_that_changes():
    curriculum = SettledPromptFilter(window=2, min_visits=2, threshold=0.5)
    solved = [1.0, 0.8, 0.0, 0.5, 1.0, 0.0]  # easy passes twice, hard never (0.5 is not above), mixed once
    assert visit(curriculum, solved) == [True, True, True]  # nothing remembered yet
    assert visit(curriculum, solved) == [True, True, True]  # one visit each: below min_visits
    assert visit(curriculum, [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]) == [False, False, True]
    # That visit was recorded: easy's last two groups passed at 1 and 1/2, mixed's at 1/2 and 1.
    assert visit(curriculum, solved) == [True, False, True]
    assert curriculum.history[int(prompt_keys(TrainingBatch(["easy"], {}, 0))[0])] == [0.5, 1.0]


def test_min_visits_below_the_window_drops_sooner():
    curriculum = SettledPromptFilter(window=3, min_visits=1)
    assert visit(curriculum, [1.0, 1.0], prompts=["easy"]) == [True]
    assert visit(curriculum, [1.0, 1.0], prompts=["easy"]) == [False]


def test_a_row_field_names_the_prompt_when_given():
    curriculum = SettledPromptFilter(window=1, min_visits=1, key="id")
    assert visit(curriculum, [1.0, 1.0], prompts=["first wording"], id=[7]) == [True]
    assert visit(curriculum, [1.0, 1.0], prompts=["second wording"], id=[7]) == [False]
    with pytest.raises(KeyError, match="key='id' is not a field"):
        visit(curriculum, [1.0, 1.0], prompts=["no id"])


def test_keys_are_stable_across_processes_and_tell_prompts_apart():
    keys = prompt_keys(TrainingBatch(["easy", "hard", [{"role": "user", "content": "easy"}]], {}, 0))
    assert keys.dtype == torch.int64 and len(set(keys.tolist())) == 3
    easy = hashlib.blake2b(b"easy", digest_size=8).digest()  # not Python's per-process hash of a str
    assert keys[0] == int.from_bytes(easy, "little", signed=True)


def test_a_curriculum_loaded_from_the_saved_state_drops_what_the_saved_one_would():
    curriculum = SettledPromptFilter(window=2, min_visits=2)
    for rewards in ([1.0, 1.0, 0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]):
        visit(curriculum, rewards)
    buffer = io.BytesIO()
    torch.save({"callbacks": {curriculum.state_key: curriculum.state_dict()}}, buffer)
    buffer.seek(0)
    resumed = SettledPromptFilter(window=2, min_visits=2)
    resumed.load_state_dict(torch.load(buffer, weights_only=True)["callbacks"][resumed.state_key])
    assert resumed.history == curriculum.history
    # Then hard's group is mixed (it comes back), mixed's failed twice (it goes).
    for rewards, kept in (
        ([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], [False, False, True]),
        ([0.0] * 6, [False, True, False]),
    ):
        assert visit(resumed, rewards) == visit(curriculum, rewards) == kept
    assert SettledPromptFilter(window=3).state_key != curriculum.state_key  # two of them keep apart


@pytest.mark.parametrize(
    ("settings", "named"), [({"window": 0}, "window"), ({"min_visits": 5}, "min_visits")]
)
def test_settings_out_of_range_are_refused_by_name(settings, named):
    with pytest.raises(ValueError, match=f"SettledPromptFilter: {named} must be"):
        SettledPromptFilter(**settings)


def test_its_first_name_still_imports_and_a_checkpoint_of_then_resumes_its_history():
    for path in ("forge_lightning.callbacks", "forge_lightning.callbacks.curriculum"):
        with pytest.warns(DeprecationWarning, match="DifficultyCurriculum is now SettledPromptFilter"):
            assert getattr(importlib.import_module(path), "DifficultyCurriculum") is SettledPromptFilter
    # The key its state was saved under before the rename, which a resume looks it up by.
    saved = "DifficultyCurriculum{'window': 2, 'min_visits': 1, 'threshold': 0.7, 'key': None}"
    assert SettledPromptFilter(window=2, min_visits=1, threshold=0.7).state_key == saved

    class Stricter(SettledPromptFilter):
        pass

    assert Stricter(window=2).state_key.startswith("test_its_first_name")  # a subclass keeps its own
