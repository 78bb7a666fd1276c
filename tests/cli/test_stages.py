"""A config's ``stages`` (cli/stages.py): one ``fit`` command runs a fit per stage, each in its own
folder from the previous one's final weights; ``--ckpt_path last`` goes on where it stopped; the
other subcommands read the config without its stages."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from forge_lightning.callbacks.hf_checkpoint import HFCheckpoint
from forge_lightning.cli.forge_cli import main
from forge_lightning.cli.stages import DONE_FILE, run_stages, staged_config, without_stages

ROOT = Path(__file__).resolve().parents[2]


def recipe(tmp_path: Path, stages: list, **top) -> Path:
    """smoke.yaml with ``stages`` (and ``top``'s sections) added."""
    config = {**yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text()), **top, "stages": stages}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.mark.parametrize(
    ("stages", "said"),
    [
        ([], "must be a non-empty list"),
        ([{"trainer": {"max_steps": 1}}], "must be a mapping with a name"),
        ([{"name": "a"}, {"name": "a"}], "must be a new folder name"),
        ([{"name": "../up"}], "must be a new folder name"),
        (
            [{"name": "a", "trainer": {"default_root_dir": "x"}}],
            "sets trainer.default_root_dir: that is the recipe's",
        ),
        ([{"name": "a", "ckpt_path": "last"}], "sets ckpt_path"),
    ],
)
def test_stages_that_cannot_run_are_refused_in_one_line(tmp_path, stages, said):
    with pytest.raises(SystemExit, match=said):
        staged_config(["fit", "--config", str(recipe(tmp_path, stages))])


class FakeFits:
    """A fit per call that records its command and stops at ``steps`` of each stage's max_steps."""

    def __init__(self, steps: list[int]):
        self.commands: list[list[str]] = []
        self.steps = steps

    def __call__(self, command: list[str]) -> SimpleNamespace:
        self.commands.append(command)
        root = command[command.index("--trainer.default_root_dir") + 1]
        trainer = SimpleNamespace(
            max_steps=3,
            global_step=self.steps[len(self.commands) - 1],
            default_root_dir=root,
            callbacks=[HFCheckpoint()],
        )
        return SimpleNamespace(trainer=trainer)


def test_each_stage_fits_after_the_configs_before_the_flags_from_the_last_ones_weights(tmp_path):
    stages = [{"name": "one", "trainer": {"max_steps": 3}}, {"name": "two", "model": {"temperature": 1.0}}]
    config = recipe(tmp_path, stages, trainer={"default_root_dir": str(tmp_path / "run")})
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("model:\n  group_size: 4\n")
    args = [
        "fit",
        "--config",
        str(config),
        "--seed_everything",
        "7",
        "--config",
        str(overlay),
        "--model.lr=1",
    ]
    fits = FakeFits([3, 3])
    run_stages(args, fits)
    first, second = fits.commands
    assert first[:3] == ["fit", "--config", first[2]] and first[2] != str(config)  # the copy without stages
    staged = next(i for i, arg in enumerate(first) if arg.endswith("stage-0-one.yaml"))
    assert first[3 : staged - 1] == ["--seed_everything", "7", "--config", str(overlay)]  # after every config
    assert first[staged + 1] == "--model.lr=1"  # the flags after it: they win
    assert first[-2:] == ["--trainer.default_root_dir", str(tmp_path / "run" / "one")]
    assert second[-2:] == ["--model.model", str(tmp_path / "run" / "one" / "final")]
    done = json.loads((tmp_path / "run" / "two" / DONE_FILE).read_text())
    final = str(tmp_path / "run" / "two" / "final")
    assert done == {"stage": "two", "steps": 3, "final": final, "at_goal": False}
    # Resumed: the done stages are skipped; nothing runs again.
    again = FakeFits([])
    run_stages([*args, "--ckpt_path", "last"], again)
    assert again.commands == []


def test_a_stage_stopped_early_ends_the_recipe_with_the_command_that_goes_on(tmp_path):
    stages = [{"name": "one"}, {"name": "two"}]
    config = recipe(tmp_path, stages, trainer={"default_root_dir": str(tmp_path / "run")})
    fits = FakeFits([2])
    with pytest.raises(SystemExit, match=r"stage one stopped at step 2 of 3 .*--ckpt_path last"):
        run_stages(["fit", "--config", str(config)], fits)
    assert len(fits.commands) == 1 and not (tmp_path / "run" / "one" / DONE_FILE).exists()
    (tmp_path / "run" / "one" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "one" / "checkpoints" / "last.ckpt").write_bytes(b"")
    resumed = FakeFits([3, 3])
    run_stages(["fit", "--config", str(config), "--ckpt_path=last"], resumed)
    assert resumed.commands[0][-2:] == ["--ckpt_path", "last"] and "--ckpt_path" not in resumed.commands[1]


def test_a_config_without_stages_passes_through_as_it_is(tmp_path):
    args = ["validate", "--config", str(ROOT / "configs" / "smoke.yaml")]
    with without_stages(args) as staged:
        assert staged.args == args and staged.stages == []


@pytest.mark.integration
def test_a_two_stage_recipe_trains_both_and_its_config_validates(tiny_model_dir, tmp_path, tiny_overrides):
    out = tmp_path / "run"
    stages = [
        {"name": "first", "trainer": {"max_steps": 1}},
        {"name": "second", "trainer": {"max_steps": 1}, "model": {"temperature": 1.0}},
    ]
    config = recipe(tmp_path, stages)
    main(["fit", "--config", str(config), *tiny_overrides(tiny_model_dir, out)])
    for name in ("first", "second"):
        assert (out / name / "final" / "config.json").is_file()
        assert json.loads((out / name / DONE_FILE).read_text())["steps"] == 1
    saved = yaml.safe_load(next((out / "second").rglob("config.yaml")).read_text())["model"]
    assert saved["model"] == str(out / "first" / "final") and saved["temperature"] == 1.0
    assert saved["group_size"] == 4  # the command line's flag, in every stage
    log = (out / "second" / "training_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in log] == [1]  # a fit of its own
    main(
        [
            "validate",
            "--config",
            str(config),
            *tiny_overrides(out / "second" / "final", tmp_path / "val"),
            "--trainer.limit_val_batches=1",
        ]
    )
