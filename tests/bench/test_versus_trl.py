"""The TRL reference harness: its script stands alone (TRL's venv has no forge_lightning), and the
driver interleaves the two sides and divides ours by TRL's."""

from __future__ import annotations

import ast
import importlib
import json
import stat
import sys

import pytest
from transformers import AutoTokenizer

from forge_lightning.bench import versus_trl
from forge_lightning.bench.versus_trl import TRL_SCRIPT


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


def test_both_sides_get_the_same_settings_and_the_same_prompts(tmp_path):
    trl_python = tmp_path / "python"
    trl_python.write_text("")
    args = versus_trl.parse_args(
        ["--trl-python", str(trl_python), "--data", str(tmp_path), "--group", "4", "--max-new-tokens", "16"]
    )
    sides = versus_trl.commands(args, "/models/m", tmp_path / "p.jsonl")
    settings = ["--prompts-per-step", "--group", "--max-new-tokens", "--steps", "--threads", "--model"]
    for flag in settings:
        trl, ours = sides["trl"], sides["forge_lightning"]
        assert trl[trl.index(flag) + 1] == ours[ours.index(flag) + 1], flag
    assert "--fixed-length" in sides["forge_lightning"] and "--no-references" in sides["forge_lightning"]


def test_the_prompts_are_the_benchmarks_gsm8k_prompts_as_chat_messages(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(
        "\n".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) for i in range(3))
    )
    out = tmp_path / "prompts.jsonl"
    versus_trl.write_prompts(str(tmp_path), 2, out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2
    assert rows[1]["prompt"][0]["role"] == "user" and "What is 1 + 1?" in rows[1]["prompt"][0]["content"]


@pytest.mark.integration
def test_the_driver_interleaves_the_sides_and_divides_ours_by_trls(tmp_path, tiny_model_dir, capsys):
    # A stand-in for TRL's python: one JSON line at 10 completion tokens/s, whatever it is asked.
    fake = tmp_path / "trl-python"
    fake.write_text(
        f"#!{sys.executable}\nimport json; print(json.dumps({{'completion_tokens_per_s': 10.0}}))\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    data = tmp_path / "train.jsonl"
    data.write_text(
        "\n".join(json.dumps({"question": f"{i} + 1?", "answer": f"#### {i + 1}"}) for i in range(4))
    )
    summary = versus_trl.main(
        [
            *("--trl-python", str(fake), "--data", str(data), "--model", str(tiny_model_dir)),
            *("--group", "2", "--max-new-tokens", "4", "--steps", "1", "--rounds", "2", "--threads", "1"),
        ]
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line.get("side") for line in lines[:4]] == ["trl", "forge_lightning"] * 2
    assert [line["round"] for line in lines[:4]] == [0, 0, 1, 1]
    ours = [line["completion_tokens_per_s"] for line in lines[1:4:2]]
    assert summary["vs_trl_rounds"] == pytest.approx([tokens / 10.0 for tokens in ours])
    assert lines[-1] == summary


def test_a_tool_step_gives_both_sides_the_same_tool_and_system_prompt(tmp_path):
    trl_python = tmp_path / "python"
    trl_python.write_text("")
    args = versus_trl.parse_args(["--trl-python", str(trl_python), "--data", str(tmp_path), "--tool"])
    sides = versus_trl.commands(args, "/models/m", tmp_path / "p.jsonl")
    trl, ours = sides["trl"], sides["forge_lightning"]
    assert "--tool" in trl and "--fixed-length" not in ours  # completions end where the model ends them
    tool = ours[ours.index("--tools") + 1]
    module, name = tool.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is trl_reference_multiply()
    assert ours[ours.index("--system-prompt") + 1] == versus_trl.TOOL_SYSTEM_PROMPT
    assert trl[trl.index("--max-tool-calls") + 1] == ours[ours.index("--max-tool-calls") + 1]


def test_a_low_precision_sampler_is_ours_alone(tmp_path):
    trl_python = tmp_path / "python"
    trl_python.write_text("")
    base = ["--trl-python", str(trl_python), "--data", str(tmp_path)]
    args = versus_trl.parse_args([*base, "--rollout-precision", "bf16"])
    sides = versus_trl.commands(args, "/models/m", tmp_path / "p.jsonl")
    ours = sides["forge_lightning"]
    assert ours[ours.index("--rollout-precision") + 1] == "bf16"
    assert "--rollout-precision" not in sides["trl"]  # TRL samples with its policy
    plain = versus_trl.commands(versus_trl.parse_args(base), "/models/m", tmp_path / "p.jsonl")
    assert "--rollout-precision" not in plain["forge_lightning"]


def trl_reference_multiply():
    from forge_lightning.bench.trl_reference import multiply

    return multiply


@pytest.mark.integration
def test_the_tool_steps_model_folder_carries_trls_qwen_template(tmp_path, tiny_model_dir):
    # A stand-in for TRL's python: it prints its package folder, which holds chat_templates/qwen2_5.jinja.
    package = tmp_path / "trl"
    (package / "chat_templates").mkdir(parents=True)
    (package / "chat_templates" / "qwen2_5.jinja").write_text("{{ messages[0]['content'] }}<tool_call>")
    fake = tmp_path / "trl-python"
    fake.write_text(f"#!/bin/sh\necho {package}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    folder = versus_trl.with_trl_template(str(fake), str(tiny_model_dir), tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template == "{{ messages[0]['content'] }}<tool_call>"
    assert (tmp_path / "model" / "model.safetensors").resolve() == (
        tiny_model_dir / "model.safetensors"
    ).resolve()
