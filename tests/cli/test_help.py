"""``forge-lightning fit --help``: plain text, and each option whose help this package writes is a
short sentence with no reST markup."""

from __future__ import annotations

import re

import pytest

from forge_lightning.cli.forge_cli import build_cli

# The options whose help this package writes: the module's settings and the CLI's own flag
# (Lightning writes the --trainer.* help, jsonargparse its own -h, --print_config and *.help).
OURS = ("--model.", "--overwrite")
MARKUP = ("``", ":class:", ":func:", ":meth:", ":attr:", ".. note", ".. warning")
# An option's lines in an 80-column terminal, its type and default included: the longest,
# --model.environment_factory's, takes 11.
MAX_LINES = 12
# argparse's column where an option's help starts (max_help_position).
HELP_COLUMN = 24


def help_text(subcommand: str, monkeypatch, capsys) -> str:
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal's width
    with pytest.raises(SystemExit):
        build_cli([subcommand, "--help"])
    return capsys.readouterr().out


def option_helps(text: str) -> dict[str, list[str]]:
    """Each option's help as printed, one entry per line: an option line starts with ``  -``, its
    help at column 24 (on the option's line where the option is short) and on the lines below."""
    helps: dict[str, list[str]] = {}
    lines = None
    for line in text.splitlines():
        if line.startswith("  -"):
            lines = helps.setdefault(line.split()[0].rstrip(","), [])
            same_line = re.match(r"  \S.*?\s{2,}(\S.*)$", line)
            if same_line and same_line.start(1) == HELP_COLUMN:
                lines.append(same_line.group(1))
        elif line.startswith(" " * HELP_COLUMN) and lines is not None:
            lines.append(line.strip())
        else:
            lines = None
    return helps


def ours(text: str) -> dict[str, list[str]]:
    helps = {name: lines for name, lines in option_helps(text).items() if name.startswith(OURS)}
    assert len(helps) >= 90, f"the help's options were not read: {sorted(helps)}"  # 89 settings, --overwrite
    return helps


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_each_option_help_starts_with_a_word_and_ends_its_sentence_before_its_type(
    subcommand, monkeypatch, capsys
):
    wrong = []
    for name, lines in ours(help_text(subcommand, monkeypatch, capsys)).items():
        sentence = " ".join(lines).split(" (type: ")[0]
        if not re.match(r"[A-Za-z`]", sentence):
            wrong.append(f"{name} starts with {sentence[:20]!r}, not a word or a `name`")
        elif not sentence.endswith("."):
            wrong.append(f"{name} ends with {sentence[-20:]!r}, not a full stop")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_no_option_help_has_rest_markup(subcommand, monkeypatch, capsys):
    text = help_text(subcommand, monkeypatch, capsys)
    wrong = [
        f"{name} has {mark}: {' '.join(lines)[:100]!r}"
        for name, lines in ours(text).items()
        for mark in MARKUP
        if mark in " ".join(lines)
    ]
    assert not wrong, "\n".join(wrong)
    assert not any(mark in text for mark in MARKUP)  # nor the headings and Lightning's own


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_each_option_help_is_short(subcommand, monkeypatch, capsys):
    long = [
        f"{name} takes {len(lines)} lines (at most {MAX_LINES}): say less, or say it in the guide"
        for name, lines in ours(help_text(subcommand, monkeypatch, capsys)).items()
        if len(lines) > MAX_LINES
    ]
    assert not long, "\n".join(long)


def test_the_option_reader_reads_short_and_long_options():
    text = (
        "options:\n"
        "  --model.top_p TOP_P   nucleus sampling mass. (type: float, default: 1.0)\n"
        "  --model.stop STOP, --model.stop+ STOP\n"
        "                        strings that end a completion.\n"
        "                        (type: list[str], default: [])\n"
        "\n"
        "Heading:\n"
    )
    assert option_helps(text) == {
        "--model.top_p": ["nucleus sampling mass. (type: float, default: 1.0)"],
        "--model.stop": ["strings that end a completion.", "(type: list[str], default: [])"],
    }


def test_the_model_argument_help_is_plain(monkeypatch, capsys):
    text = help_text("fit", monkeypatch, capsys)
    assert "the model spec: embedded" in text
    assert "PreTrainedModel" not in text and "--model.tokenizer" not in text


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_the_help_is_plain_text_with_whole_sentence_headings(subcommand, monkeypatch, capsys):
    text = help_text(subcommand, monkeypatch, capsys)
    assert text.splitlines()[0].startswith("usage:") and len(text.split("\n\n")[0].splitlines()) == 1
    joined = " ".join(text.split())
    assert "completions per prompt (G), at least 2. (type: int, default: 8)" in joined
    # What a null setting means is kept, and headings are whole sentences.
    assert (
        "train a LoRA adapter (lora.LoraSettings or a dict of its fields); None trains every weight."
        in joined
    )
    assert "optimizer steps and:" not in text and "The main advantage is:" not in text
    # --data takes any datamodule, so its settings are not listed: the help says how to see them.
    assert "--data.help forge_lightning.data.PromptDataModule" in joined
    assert "--hf_checkpoint.help HFCheckpoint; off with --hf_checkpoint null" in joined
