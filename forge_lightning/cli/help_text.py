"""The command's help and errors made short: every option's help its first sentence, group headings of
whole sentences, and jsonargparse's Union error cut to the one line that says what was refused."""

from __future__ import annotations

import argparse
import inspect
import re

from lightning.pytorch.cli import LightningArgumentParser

from forge_lightning.cli.parser_internals import parts

# jsonargparse's error for a value no type of a Union setting takes (model.reward, data): the
# subtypes, each one's error, and the value, in 10 to 40 lines.
_UNION_ERROR = "Does not validate against any of the Union subtypes"


def one_line_error(message: str) -> str:
    """``message``, or where it is jsonargparse's Union error whose only error that is not a type
    mismatch is one line (what a class named in the config refused, e.g. RewardModel's), that line."""
    if not message.startswith(_UNION_ERROR):
        return message
    lines = message.splitlines()
    errors = [(k, line[len("  - ") :]) for k, line in enumerate(lines) if line.startswith("  - ")]
    said = [(k, text) for k, text in errors if not text.startswith("Expected a ")]
    if len(said) != 1:
        return message
    k, text = said[0]
    continued = k + 1 < len(lines) and lines[k + 1].startswith("    ")
    return message if continued else text


_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :class:`~a.b.C` and friends


def _plain(text: str) -> str:
    """A docstring fragment as plain text: no reST roles or double backquotes, one line."""
    text = _ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0) else m.group(1), text)
    return " ".join(text.replace("``", "").split())


_SENTENCE_END = re.compile(r"(?<=\.)\s+(?=[A-Z])")
_CLASS_PATH = re.compile(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)")


def _first_sentence(text: str) -> str:
    """The first sentence of ``text``, in plain text, and a next one that says what None means
    (``None trains every weight.``): what a null setting does is part of what the setting is."""
    first, *rest = _SENTENCE_END.split(_plain(text))
    if rest and rest[0].startswith("None"):
        first = f"{first} {rest[0]}"
    return first


def _group_headings(parser: LightningArgumentParser, class_groups: dict[str, type]) -> None:
    """A heading of whole sentences for each group that takes a class (``--data`` and the callback
    groups), saying how to list its settings: those of a class chosen by ``--<group> CLASS`` are
    not in this help."""
    titles = {
        "data": "The datamodule: PromptDataModule unless --data names another LightningDataModule",
        "checkpoint": "Lightning's ModelCheckpoint: the training state that --ckpt_path last resumes",
    }
    for key in ("data", *class_groups):
        group = parser.groups.get(key)
        if group is None:
            continue
        kind = class_groups.get(key)
        if kind is None:
            group.description = (
                f"Its settings (--{key}.<setting>): --{key}.help forge_lightning.data.PromptDataModule"
            )
        else:
            summary = _first_sentence(inspect.getdoc(kind).split("\n\n")[0]).rstrip(".")
            titles.setdefault(key, summary)
            group.description = (
                f"Its settings (--{key}.<setting>): --{key}.help {kind.__name__}; off with --{key} null"
            )
        group.title = titles[key]


def _short_subclass_list(action: argparse.Action) -> None:
    """The "known subclasses" jsonargparse lists after a class option, by class name (which the
    option accepts too), not by dotted path: the Trainer's callbacks and plugins alone took 60 lines."""
    extra_help = getattr(action, "extra_help", None)
    if extra_help is not None:
        action.extra_help = lambda: _CLASS_PATH.sub(r"\1", extra_help())


def shorten_help(parser: LightningArgumentParser, class_groups: dict[str, type]) -> None:
    """Help that fits a screen: every option's text cut to its first sentence (and what None means),
    in plain text (the type and default jsonargparse adds stay), group headings of whole sentences,
    and a one-line usage instead of every flag. ``class_groups``: the callback groups, each a class
    whose settings ``--<group>.help CLASS`` lists."""
    actions, groups = parts(parser)
    for action in actions:
        if action.help and action.help is not argparse.SUPPRESS:
            action.help = _first_sentence(action.help)
        _short_subclass_list(action)
    for group in groups:
        group.title = group.title and _plain(group.title)
        group.description = group.description and _plain(group.description)
    _group_headings(parser, class_groups)
    parser.usage = (
        "%(prog)s [-h] [-c CONFIG] [--print_config] [--trainer.<setting> VALUE ...] "
        "[--model.<setting> VALUE ...] [--data.<setting> VALUE ...] [--ckpt_path CKPT_PATH]"
    )
