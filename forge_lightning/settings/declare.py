"""How a setting is declared: once, as a field of its group's dataclass (settings/groups/).

A field holds the setting's name (the field's, or ``name=`` where the group calls it otherwise),
type, default, range (``check``: a predicate and the range in words), whether a resumed run
may change it (``resume=True``) and whether a checkpoint's model card shows it (``card=True``);
its help is the attribute docstring under it. The module's
signature and help (settings/signature.py), the CLI's flags (read from those), the guide's
settings table, the range checks (checks.RULES) and the resume rules (groups.CHANGEABLE_ON_RESUME)
are all read from the fields. A setting's former name is an :class:`OldName` in its group's
``old_names``: a flag and keyword still taken, its value given to the setting it became.
"""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
import warnings
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields
from functools import cache
from typing import Any, ClassVar

# (predicate, the allowed range in words, or a function that says it when asked)
Rule = tuple[Callable[[Any], bool], "str | Callable[[], str]"]


def setting(
    default: Any,
    *,
    check: Rule | None = None,
    resume: bool = False,
    name: str | None = None,
    card: bool = False,
) -> Any:
    """A group's field declaring one setting: its ``default``, its range (``check``), whether a
    resumed run may change it (``resume``), the module's name for it where the field's differs,
    and whether the model card of a saved checkpoint lists it (``card``)."""
    metadata: dict[str, Any] = {"resume": resume, "card": card}
    if check is not None:
        metadata["check"] = check
    if name is not None:
        metadata["setting"] = name
    if isinstance(default, list | dict):
        raise TypeError("a setting's default is immutable (None for an empty list or dict)")
    return field(default=default, metadata=metadata)


def optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """``check``, also passing None."""
    return lambda v: v is None or check(v)


def at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and v >= low


def setting_name(item: Field) -> str:
    """The module's name (``--model.<name>``) of a group's dataclass field."""
    return item.metadata.get("setting", item.name)


def check_value(name: str, value: Any, rule: Rule) -> None:
    """Raise ValueError naming the setting ``name`` when ``value`` is outside ``rule``'s range."""
    allowed, words = rule
    words = words() if callable(words) else words
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be finite ({words}), got {value!r}")
    try:
        ok = bool(allowed(value))
    except TypeError:
        ok = False
    if isinstance(value, bool) or not ok:
        raise ValueError(f"{name} must be {words}, got {value!r}")


def check_fields(group: Any) -> None:
    """Check each field of a group's instance against its declared range."""
    for item in fields(group):
        if "check" in item.metadata:
            check_value(setting_name(item), getattr(group, item.name), item.metadata["check"])


@cache
def attribute_docs(kind: type) -> dict[str, str]:
    """Each field's attribute docstring (the string under it in the class body), by field name,
    as one paragraph."""
    body = ast.parse(textwrap.dedent(inspect.getsource(kind))).body[0]
    assert isinstance(body, ast.ClassDef)
    found = {}
    for item, after in zip(body.body, body.body[1:], strict=False):
        if (
            isinstance(item, ast.AnnAssign)
            and isinstance(item.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            found[item.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return found


@dataclass(frozen=True)
class OldName:
    """A setting's former name, still taken wherever it was (the flag, the keyword, a config's and a
    checkpoint's key) with a DeprecationWarning: its value goes to the setting ``new``.
    ``old_defaults``: the defaults of the names before the rename, which every config and
    checkpoint saved then holds; in a mapping that holds the old name, such a value says nothing
    (the new setting's default stands)."""

    name: str
    new: str
    old_defaults: tuple[tuple[str, Any], ...] = ()

    def help(self) -> str:
        return f"deprecated: the former name of ``{self.new}``, which it sets."

    def applied(self, values: Mapping[str, Any], default: Any) -> dict[str, Any]:
        """``values`` with the old name's value given to ``new`` (``default``: ``new``'s); ValueError
        where both say something and differ."""
        found = {key: value for key, value in values.items() if key != self.name}
        if self.name not in values:
            return found
        old, new = values[self.name], values.get(self.new, default)
        was = dict(self.old_defaults)

        def says(name: str, value: Any) -> bool:
            return value != default and not (name in was and value == was[name])

        if says(self.name, old):
            warnings.warn(f"{self.name} is deprecated: use {self.new}", DeprecationWarning, stacklevel=4)
            if says(self.new, new) and new != old:
                raise ValueError(
                    f"{self.name}={old!r} and {self.new}={new!r} are one setting given twice: give "
                    f"{self.new} alone ({self.name} is its former name)"
                )
        found[self.new] = old if says(self.name, old) else new if says(self.new, new) else default
        return found


class Group:
    """A settings group (a frozen dataclass of :func:`setting` fields): its fields' ranges checked
    when it is made. ``old_names``: its settings' former names."""

    old_names: ClassVar[tuple[OldName, ...]] = ()

    def __post_init__(self) -> None:
        check_fields(self)


# Ranges many settings share.
POSITIVE: Rule = (lambda v: v > 0, "> 0")
SECONDS: Rule = (optional(lambda v: v > 0), "None or > 0 (seconds)")
SHARE: Rule = (lambda v: 0 < v <= 1, "in (0, 1]")


def count(low: int) -> Rule:
    """An integer of at least ``low``."""
    return at_least(low), f"an integer >= {low}"


def maybe_count(low: int) -> Rule:
    """None, or an integer of at least ``low``."""
    return optional(at_least(low)), f"None or an integer >= {low}"


def one_of(*choices: Any) -> Rule:
    """One of ``choices``, named as ``'a' or 'b'``."""
    return (lambda v: v in choices), " or ".join(map(repr, choices))
