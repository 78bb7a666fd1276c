"""The argparse and jsonargparse internals the command's help and its model option need, one function each."""

from __future__ import annotations

import argparse
import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser

# argparse and jsonargparse have no public way to list a parser's actions, to find the action of
# an option string, to change the type of an option already added, or to parse without
# validating. Each private use is one function below, checked on jsonargparse 4.40.0 and 4.53.0
# (argparse of Python 3.11); tests/test_private_api.py fails if one moves.


def option(parser: argparse.ArgumentParser, name: str) -> argparse.Action | None:
    """The action of option string ``name`` (``--model.model``), None where the parser has none."""
    return parser._option_string_actions.get(name)


def parts(parser: argparse.ArgumentParser) -> tuple[list[argparse.Action], list[Any]]:
    """The parser's actions and its argument groups (argparse's ``_actions``, ``_action_groups``)."""
    return parser._actions, parser._action_groups


def read_as_string(action: argparse.Action) -> bool:
    """Make jsonargparse take ``action``'s value as a plain string, never a path it would open and
    read as YAML. False where the action is not jsonargparse's type-hint action (as in older ones)."""
    if not hasattr(action, "_enable_path"):
        return False
    action._enable_path = False
    action._typehint = str
    return True


def parse_unvalidated(parser: LightningArgumentParser, args: Any, defaults: bool = True) -> Any:
    """``parse_args`` without the validation (jsonargparse's private ``_skip_validation`` keyword),
    for a config that is validated once the loggers have their folders; ``defaults=False``: only
    what the config files and the command line set. A nested flag changes a single value in place
    (:func:`nested_flags_keep_single_values`)."""
    with nested_flags_keep_single_values():
        return parser.parse_args(args, defaults=defaults, _skip_validation=True)


@contextlib.contextmanager
def nested_flags_keep_single_values() -> Iterator[None]:
    """While parsing, a nested flag (``--model.reward.init_args.url X``) on a setting that is one
    class (not a list) sets that class's argument. For a ``list[X] | X`` setting (``model.reward``)
    jsonargparse tries the list first, and its list takes a nested flag by wrapping the value in a
    list of one: another setting, which a resume refuses. Its private ``sort_subtypes_for_union``
    moves the list types first for a list's nested flag; here they go last for any other value's.
    Checked on jsonargparse 4.53.0; nothing changes where jsonargparse has no such function, or one
    of another signature (4.40's takes no ``append``)."""
    from jsonargparse import _typehints

    original = getattr(_typehints, "sort_subtypes_for_union", None)
    if original is None or list(inspect.signature(original).parameters) != [
        "subtypes",
        "val",
        "prev_val",
        "append",
    ]:
        yield
        return

    def ordered(subtypes: Any, val: Any, prev_val: Any, append: bool) -> Any:
        subtypes = original(subtypes, val, prev_val, append)
        if isinstance(val, _typehints.NestedArg) and not append and not isinstance(prev_val, list | None):
            sequences = _typehints.sequence_origin_types
            subtypes = sorted(subtypes, key=lambda t: _typehints.get_typehint_origin(t) in sequences)
        return subtypes

    _typehints.sort_subtypes_for_union = ordered
    try:
        yield
    finally:
        _typehints.sort_subtypes_for_union = original
