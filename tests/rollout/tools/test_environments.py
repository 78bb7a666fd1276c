"""Several environments in one run: ``environment_factory`` a mapping name -> factory, each row's
``environment`` field (TRL's column) picking its own; its prompt shows its own tools, its calls run
on its own environment, and a row naming an unknown one is refused with the names there are."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers.engines import TurnEngine
from helpers.tools import GREEDY, Counter, TrlCounter, add, call, chat_tokenizer, make_counter, sampler, tiny

from forge_lightning.module import GRPOLightningModule
from forge_lightning.rewards.environment import EnvironmentReward
from forge_lightning.rollout.engines.base import Completions, GenerationRequest


class Doubler:
    """An environment whose value doubles; its target comes from the row."""

    def __init__(self) -> None:
        self.value, self.target = 1, None

    def reset(self, reference: str) -> str:
        self.target = int(reference)
        return f"Double 1 up to {reference}."

    def double(self) -> int:
        """Double the value."""
        self.value *= 2
        return self.value

    def increment(self, by: int) -> int:
        """Add to the value (a name Counter has too: a row has one environment).

        Args:
            by: how much.
        """
        self.value += by
        return self.value

    def get_reward(self) -> float:
        return float(self.value == self.target)


class Script(TurnEngine):
    """A TurnEngine whose turns depend on the environment each row's prompt shows."""

    def __init__(self, tok, by_environment: dict[str, list[str]]) -> None:
        super().__init__(tok, [])
        self.by_environment = by_environment

    def generate(self, model, request: GenerationRequest) -> Completions:
        rows = []
        for ids, mask in zip(request.prompt_ids, request.prompt_mask):
            text = self.tok.decode(ids[mask.bool()])
            self.turns = next(turns for key, turns in self.by_environment.items() if key in text)
            row = replace(request, prompt_ids=ids[None], prompt_mask=mask[None])
            rows += super().generate(model, row).ids.tolist()
        width = max(map(len, rows))
        return Completions(torch.tensor([row + [self.tok.pad_token_id] * (width - len(row)) for row in rows]))


ENVIRONMENTS = {"counter": Counter, "doubler": Doubler}


def test_each_row_gets_the_environment_its_field_names_and_shows_its_tools():
    tok = chat_tokenizer()
    engine = Script(tok, {"Reach": [call("increment", by=4), "done."], "Double": [call("double"), "done."]})
    run = sampler(tok, [add], engine, env=ENVIRONMENTS)
    rows = {"environment": ["doubler", "counter"], "references": ["2", "4"]}
    rollout = run(tiny(tok), ["Q", "R"], GREEDY, 2, rows=rows)

    prompts = [tok.decode(ids[mask.bool()]) for ids, mask in zip(rollout.prompt_ids, rollout.prompt_mask)]
    assert "Tools: add double increment" in prompts[0] and "Double 1 up to 2." in prompts[0]
    assert "Tools: add increment" in prompts[1] and "Reach 4." in prompts[1]
    envs = rollout.facts()["environments"]
    assert [type(e) for e in envs] == [Doubler, Doubler, Counter, Counter]
    assert [e.value for e in envs[:2]] == [2, 2] and [e.count for e in envs[2:]] == [4, 4]
    assert EnvironmentReward()(["Q"] * 4, rollout.completions, environments=envs).scores == [1.0] * 4
    assert set(run.tools.names) == {"add", "double", "increment"}


@pytest.mark.parametrize(
    ("rows", "said"), [({"environment": ["chess"]}, "names 'chess'"), ({}, "has no 'environment' field")]
)
def test_a_row_naming_no_known_environment_is_refused_with_the_names_there_are(rows, said):
    tok = chat_tokenizer()
    run = sampler(tok, None, TurnEngine(tok, ["x"]), env=ENVIRONMENTS)
    with pytest.raises(ValueError, match=f"a row {said}: .* one of 'counter', 'doubler'"):
        run(tiny(tok), ["Q"], GREEDY, 1, rows={**rows, "references": ["1"]})


def test_several_environments_are_stored_by_import_path_and_score_the_run():
    tok = chat_tokenizer()
    grpo = GRPOLightningModule(
        model=tiny(tok), tokenizer=tok, environment_factory={"doubler": Doubler, "trl": make_counter}
    )
    assert grpo.hparams.environment_factory == {
        "doubler": "test_environments.Doubler",
        "trl": "helpers.tools.make_counter",
    }
    assert grpo.tools.environments == {"doubler": Doubler, "trl": TrlCounter}
    assert grpo.tools.names == ["double", "increment"]
    assert isinstance(grpo.reward, EnvironmentReward)  # every environment scores its episodes
    again = GRPOLightningModule(
        model=tiny(tok), tokenizer=tok, environment_factory=grpo.hparams.environment_factory
    )
    assert again.tools.factory == {"doubler": Doubler, "trl": make_counter}
    unscored = GRPOLightningModule(
        model=tiny(tok), tokenizer=tok, environment_factory={"d": Doubler, "n": NoScore}
    )
    assert not isinstance(unscored.reward, EnvironmentReward)


class NoScore:
    def reset(self) -> None:
        pass


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ({}, "environment_factory as a mapping names each environment"),
        ({"": Doubler}, "environment_factory as a mapping names each environment"),
        ({"d": 3}, r"environment_factory\['d'\] must be a class"),
        ({"d": Doubler}, "two tools have the name increment"),
    ],
)
def test_a_bad_mapping_of_environments_is_refused_by_name(factory, message):
    tok = chat_tokenizer()
    with pytest.raises(ValueError, match=message):
        GRPOLightningModule(model=tiny(tok), tokenizer=tok, tools=[increment], environment_factory=factory)


def increment(by: int) -> int:
    """A function tool whose name an environment's method has.

    Args:
        by: how much.
    """
    return by


@pytest.mark.integration
def test_several_environments_are_set_from_the_command_line_by_import_path(
    tiny_model_dir, tmp_path, tiny_overrides
):
    from pathlib import Path

    from forge_lightning.cli.forge_cli import build_cli

    smoke = Path(__file__).resolve().parents[3] / "configs" / "smoke.yaml"
    mapping = "{doubler: test_environments.Doubler, counter: helpers.tools.Counter}"
    flag = f"--model.environment_factory={mapping}"
    cli = build_cli(["--config", str(smoke), *tiny_overrides(tiny_model_dir, tmp_path), flag], run=False)
    assert cli.model.tools.factory == {"doubler": Doubler, "counter": Counter}
    assert cli.model.hparams.environment_factory == {
        "doubler": "test_environments.Doubler",
        "counter": "helpers.tools.Counter",
    }
