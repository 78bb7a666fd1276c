"""The time-to-accuracy race against TRL: TRL's script stands alone and reads answers as our reward
does, both sides get the config's settings and train part, and the record says who got where when."""

from __future__ import annotations

import ast
import fcntl
import json
import stat
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from helpers.models import make_tokenizer

from forge_lightning.bench import time_to_accuracy, trl_time_reference, wall_clock_checkpoints
from forge_lightning.bench.time_to_accuracy import TRL_SCRIPT
from forge_lightning.bench.time_to_accuracy_summary import accuracy_at, first_reaching, summarize
from forge_lightning.bench.wall_clock_checkpoints import WallClockCheckpoints
from forge_lightning.data.datamodule import PromptDataModule
from forge_lightning.rewards import GSM8KAnswerReward

CONFIG = Path(__file__).parents[2] / "configs" / "arithmetic_cpu.yaml"

# Completions whose answer takes the reading's every rule: boxed, the Answer line (its first
# number, its last occurrence, any case), the last number, thousands, dollars, decimals, signs.
TRICKY = [
    ("3 + 4 = 7\nAnswer: 7", "7"),
    ("Answer: 7\nwait, 3 + 5 = 8\nanswer: 8", "8"),
    ("Answer: 12 apples, not 13", "12"),
    ("The total is $1,800.00 in all", "1800"),
    ("\\boxed{\\text{18}} and then 20", "18"),
    ("\\boxed{18} Answer: 20", "18"),
    ("10-3 leaves 7", "7"),
    ("It drops to -3", "-3"),
    ("Answer: 7.50", "7.5"),
    ("1,2,3 are three numbers", "3"),
    ("no number at all", "0"),
    ("Answer: none, but 5 was said", "5"),
    ("answer:", "1"),
    ("Half is .5", "0.5"),
    ("Answer: -0", "0"),
]


def test_the_trl_script_imports_nothing_of_this_package_and_trl_only_when_it_runs():
    tree = ast.parse(TRL_SCRIPT.read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert "forge_lightning" not in imported
    top_level = {
        alias.name.split(".")[0]
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    } | {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    assert not top_level & {"trl", "torch", "transformers", "datasets"}  # --help works anywhere


def test_trls_reward_scores_every_tricky_completion_as_ours_does():
    texts, references = [t for t, _ in TRICKY], [r for _, r in TRICKY]
    ours = GSM8KAnswerReward()(["p"] * len(texts), texts, references=references).scores
    conversational = [[{"role": "assistant", "content": t}] for t in texts]
    assert trl_time_reference.correctness(conversational, reference=references) == ours
    assert trl_time_reference.correctness(texts, reference=references) == ours
    assert 0 < sum(ours) < len(ours)  # the list holds right and wrong answers
    wrong = [str(int(float(r)) + 1) for r in references]
    assert (
        trl_time_reference.correctness(texts, reference=wrong)
        == GSM8KAnswerReward()(["p"] * len(texts), texts, references=wrong).scores
    )


def test_ours_reaching_trls_final_in_a_third_of_its_time_meets_the_goal():
    ours = [(0.0, 0.2), (300.0, 0.5), (600.0, 0.6), (1800.0, 0.7)]
    trl = [(0.0, 0.2), (300.0, 0.3), (900.0, 0.5), (1500.0, 0.4), (1810.0, 0.5)]
    summary = summarize(ours, trl)
    assert summary["ours_final"] == 0.7 and summary["trl_final"] == 0.5
    assert summary["ours_time_to_trl_final_s"] == 300.0
    assert summary["trl_time_s"] == 900.0  # its first checkpoint at 0.5, not its last
    assert summary["ratio"] == pytest.approx(1 / 3) and summary["goal_met"]
    assert summary["lower_final"] == 0.5
    assert summary["time_to_lower_final_s"] == {"ours": 300.0, "trl": 900.0}
    assert summary["equal_time_s"] == 1800.0
    assert (summary["ours_at_equal_time"], summary["trl_at_equal_time"]) == (0.7, 0.4)


def test_when_trl_ends_higher_ours_never_reaches_it_and_the_lower_final_is_ours():
    ours = [(0.0, 0.2), (600.0, 0.3), (1805.0, 0.35)]
    trl = [(0.0, 0.2), (600.0, 0.4), (1801.0, 0.45)]
    summary = summarize(ours, trl)
    assert summary["ours_time_to_trl_final_s"] is None
    assert summary["ratio"] is None and not summary["goal_met"]
    assert summary["lower_final"] == 0.35
    assert summary["time_to_lower_final_s"] == {"ours": 1805.0, "trl": 600.0}


def test_a_final_the_untrained_model_already_scored_has_no_ratio():
    summary = summarize([(0.0, 0.3), (10.0, 0.3)], [(0.0, 0.3), (12.0, 0.2)])
    assert summary["trl_time_s"] == 0.0 and summary["ratio"] is None and not summary["goal_met"]
    with pytest.raises(ValueError, match="at least one"):
        summarize([], [(0.0, 0.1)])


def test_accuracy_at_a_time_is_the_last_checkpoint_saved_by_then():
    points = [(300.0, 0.4), (0.0, 0.1), (600.0, 0.5)]
    assert [accuracy_at(points, t) for t in (-1.0, 0.0, 299.0, 300.0, 1e9)] == [None, 0.1, 0.1, 0.4, 0.5]
    assert first_reaching(points, 0.45) == 600.0 and first_reaching(points, 0.9) is None


def test_both_sides_get_the_configs_settings_and_the_same_budget(tmp_path):
    trl_python = tmp_path / "python"
    trl_python.write_text("")
    args = time_to_accuracy.parse_args(
        ["--trl-python", str(trl_python), "--seed", "7", "--budget-s", "60", "--config", str(CONFIG)]
    )
    settings = time_to_accuracy.shared_settings(str(CONFIG))
    assert (settings["group_size"], settings["max_new_tokens"], settings["prompts_per_step"]) == (8, 96, 4)
    sides = time_to_accuracy.commands(args, settings, "/models/m", tmp_path)
    trl, ours = sides["trl"], sides["ours"]
    flags = {"--group": 8, "--max-new-tokens": 96, "--temperature": 0.8, "--learning-rate": 1.5e-5}
    for flag, value in {**flags, "--kl-beta": 0.0, "--prompts-per-step": 4, "--seed": 7}.items():
        assert float(trl[trl.index(flag) + 1]) == value, flag
    assert (
        ours[ours.index("--config") + 1] == str(CONFIG)
        and ours[ours.index("--model.model") + 1] == "/models/m"
    )
    assert ours[ours.index("--data.seed") + 1] == ours[ours.index("--seed_everything") + 1] == "7"
    callback = json.loads(next(a for a in ours if a.startswith("--trainer.callbacks+=")).split("=", 1)[1])
    assert callback["init_args"]["budget_s"] == float(trl[trl.index("--budget-s") + 1]) == 60.0
    assert callback["init_args"]["every_s"] == float(trl[trl.index("--checkpoint-every-s") + 1])


def test_trl_trains_on_the_datamodules_train_part_with_the_system_prompt(tmp_path):
    settings = time_to_accuracy.shared_settings(str(CONFIG))
    count = time_to_accuracy.write_prompts(settings, tmp_path / "prompts.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    data = PromptDataModule(source="arithmetic", task_variant=settings["task_variant"], max_samples=None)
    data.setup("fit")
    assert count == len(rows) == len(data._train) == 250
    assert [r["prompt"][1]["content"] for r in rows] == [s["prompt"] for s in data._train]
    assert [r["reference"] for r in rows] == [s["reference"] for s in data._train]
    assert {r["prompt"][0]["content"] for r in rows} == {settings["system_prompt"]}


def test_a_seeds_record_replaces_that_seeds_alone(tmp_path):
    out = tmp_path / "figures" / "tta.json"
    time_to_accuracy.write_record(out, {"seed": 42, "ours_final": 0.1})
    time_to_accuracy.write_record(out, {"seed": 7, "ours_final": 0.2})
    records = time_to_accuracy.write_record(out, {"seed": 42, "ours_final": 0.3})
    assert (
        records
        == json.loads(out.read_text())
        == [{"seed": 7, "ours_final": 0.2}, {"seed": 42, "ours_final": 0.3}]
    )


def test_a_record_waits_for_another_writer_of_the_file(tmp_path):
    """Two seeds run at once write one file: a writer holding it (here the test) is waited for, and
    its record kept. Without the lock the thread would write first and the test's write replace it."""
    out = tmp_path / "tta.json"
    out.write_text("")
    with out.open("r+") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        writer = threading.Thread(target=time_to_accuracy.write_record, args=(out, {"seed": 42}))
        writer.start()
        writer.join(timeout=0.3)
        assert writer.is_alive()  # waiting for the lock
        other.write(json.dumps([{"seed": 7}]))
        other.flush()
        fcntl.flock(other, fcntl.LOCK_UN)
    writer.join(timeout=10)
    assert json.loads(out.read_text()) == [{"seed": 7}, {"seed": 42}]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_our_checkpoints_fall_at_training_time_marks_and_the_budget_stops_the_fit(tmp_path, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(wall_clock_checkpoints.time, "perf_counter", clock)
    callback = WallClockCheckpoints(str(tmp_path), every_s=1.0, budget_s=3.5)
    saved = []

    def save(trainer, pl_module, name):
        saved.append((name, callback.elapsed()))
        clock.now += 5.0  # writing a folder takes time the clock must not count
        return tmp_path / name

    monkeypatch.setattr(callback._writer, "save", save)
    trainer = SimpleNamespace(global_step=0, is_global_zero=True, should_stop=False)
    for seconds in (0.6, 0.6, 1.3, 0.2, 1.0):  # elapsed 0.6, 1.2, 2.5 (past mark 2), 2.7, 3.7
        callback.on_train_batch_start(trainer, object(), None, 0)
        clock.now += seconds
        trainer.global_step += 1
        callback.on_train_batch_end(trainer, object(), None, None, 0)
    assert saved == [("2", pytest.approx(1.2)), ("3", pytest.approx(2.5)), ("final", pytest.approx(3.7))]
    assert trainer.should_stop
    lines = wall_clock_checkpoints.read_checkpoints(tmp_path)
    assert [(line["name"], line["step"], line["elapsed_s"]) for line in lines] == [
        ("2", 2, 1.2),
        ("3", 3, 2.5),
        ("final", 5, 3.7),
    ]
    callback.on_train_end(trainer, object())
    assert len(saved) == 3  # the final is written once
    with pytest.raises(ValueError, match="every_s"):
        WallClockCheckpoints(str(tmp_path), every_s=0, budget_s=1.0)


# A stand-in for TRL's python: it keeps its arguments and saves the untrained model as its final
# checkpoint, at the budget, in the real script's log format.
FAKE_TRL = """\
import json, shutil, sys
from pathlib import Path
argv = sys.argv[2:]
flag = lambda name: argv[argv.index(name) + 1]
out = Path(flag("--out"))
(out / "argv.json").write_text(json.dumps(argv))
shutil.copytree(flag("--model"), out / "final")
line = {"name": "final", "folder": str(out / "final"), "step": 3, "elapsed_s": float(flag("--budget-s"))}
(out / "checkpoints.jsonl").write_text(json.dumps(line) + "\\n")
"""


@pytest.mark.integration
def test_the_driver_races_both_sides_and_records_the_seed(tmp_path, tiny_model_dir):
    model = tmp_path / "model"  # the tiny model with a chat template: the config's prompts need one
    model.mkdir()
    for item in tiny_model_dir.iterdir():
        if not item.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (model / item.name).symlink_to(item)
    make_tokenizer(chat_template=True).save_pretrained(model)
    config = yaml.safe_load(CONFIG.read_text())
    config["model"] |= {"group_size": 2, "max_new_tokens": 4}
    config["data"] |= {"prompts_per_step": 2, "max_samples": 8, "val_batch_size": 2}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    fake = tmp_path / "trl-python"
    fake.write_text(f"#!{sys.executable}\n{FAKE_TRL}")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "figures" / "tta.json"
    record = time_to_accuracy.main(
        [
            *("--trl-python", str(fake), "--seed", "5", "--budget-s", "1", "--threads", "1"),
            *("--checkpoint-every-s", "60", "--eval-problems", "2", "--eval-jobs", "3"),
            *("--out", str(out), "--work", str(tmp_path / "work"), "--config", str(tmp_path / "config.yaml")),
            *("--model", str(model)),
        ]
    )
    assert json.loads(out.read_text()) == [json.loads(json.dumps(record))]
    for key in (
        "seed",
        "threads",
        "budget_s",
        "ours_final",
        "trl_final",
        "ours_time_to_trl_final_s",
        "trl_time_s",
    ):
        assert key in record, key
    assert (record["seed"], record["threads"], record["budget_s"]) == (5, 1, 1.0)
    assert record["trl_points"] == [(0.0, record["base_accuracy"]), (1.0, record["trl_final"])]
    (start, _), (ours_elapsed, ours_final) = record["ours_points"]  # only final: the mark is past the budget
    assert start == 0.0 and ours_elapsed >= 1.0 and ours_final == record["ours_final"]
    assert all(0.0 <= accuracy <= 1.0 for _, accuracy in record["ours_points"] + record["trl_points"])
    argv = json.loads((tmp_path / "work" / "seed-5" / "trl" / "argv.json").read_text())
    assert argv[argv.index("--group") + 1] == "2" and argv[argv.index("--max-new-tokens") + 1] == "4"
    assert set(record["commands"]) == {"driver", "trl", "ours", "evaluate"}
    assert "validate" in record["commands"]["evaluate"] and "fit" in record["commands"]["ours"]


NOTEBOOK = Path(__file__).parents[2] / "notebooks" / "time_to_accuracy.ipynb"


def test_the_committed_notebook_is_saved_executed():
    nbformat = pytest.importorskip("nbformat")
    code = [cell for cell in nbformat.read(NOTEBOOK, as_version=4).cells if cell.cell_type == "code"]
    assert code and all(cell.execution_count is not None and cell.outputs for cell in code)


@pytest.mark.integration
def test_the_notebook_tables_each_seeds_record_and_its_goal(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    ours, trl = [(0.0, 0.2), (300.0, 0.5), (1801.0, 0.6)], [(0.0, 0.2), (900.0, 0.5), (1802.0, 0.5)]
    record = {"seed": 7, "threads": 2, "budget_s": 1800.0, **summarize(ours, trl), "base_accuracy": 0.2}
    record |= {"ours_points": ours, "trl_points": trl, "eval_problems": 200, "date": "2026-01-01"}
    record["commands"] = {"driver": "python -m forge_lightning.bench.time_to_accuracy --seed 7"}
    records = tmp_path / "tta.json"
    records.write_text(json.dumps([record]))
    monkeypatch.setenv("FORGE_TTA_RECORDS", str(records))
    monkeypatch.setenv("FORGE_NOTEBOOK_FIGURES", str(tmp_path))  # its plot, not the committed one
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3").execute()
    cells = {cell.get("id"): cell for cell in notebook.cells}
    table = cells["records"].outputs[0]["data"]["text/markdown"].splitlines()
    row = [c.strip() for c in table[2].strip("|").split("|")]
    assert row[:9] == ["7", "2", "1800", "0.600", "0.500", "300", "900", "0.33", "yes"]
    assert row[-1] == "trl"  # the side trained first: TRL's, unless the record says otherwise
    assert "--seed 7" in "".join(o.get("text", "") for o in cells["commands"].outputs)
    assert (tmp_path / "time_to_accuracy.png").read_bytes().startswith(b"\x89PNG")
