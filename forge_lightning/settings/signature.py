"""The module's signature and help, read from the settings' declarations (settings/groups/).

GRPOLightningModule's ``__init__`` names only the objects it is given (the model, the reward,
...) and takes every setting as a keyword; :func:`settings_signature` gives it the signature
of all of them, each setting keyword-only with its declared type and default, in the groups'
order (a former name after its group's, with its setting's type and default), and
:func:`documented_settings` adds each setting's help to the class's ``Args:``.
LightningCLI (jsonargparse) reads both for the ``--model.<name>`` flags and their help, Lightning's
``load_from_checkpoint`` and ``save_hyperparameters`` the signature, and :func:`settings_table`
both for the guide's settings table (notebooks/guide.ipynb shows it, a test checks it current).
"""

from __future__ import annotations

import contextlib
import inspect
import textwrap
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from typing import Any, TypeVar, get_type_hints

from forge_lightning.settings.declare import setting_name
from forge_lightning.settings.groups import DECLARED, current_names, declared_fields, setting_help

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T", bound=type)


def setting_parameters(declared: Mapping[str, type] = DECLARED) -> list[inspect.Parameter]:
    """Every setting ``declared`` (groups by name) as a keyword-only parameter, in their order, each
    group's former names after its settings."""
    found = []
    for kind in declared.values():
        hints = get_type_hints(kind)
        names = [(setting_name(item), item) for item in fields(kind)]
        names += [
            (old.name, next(i for i in fields(kind) if setting_name(i) == old.new)) for old in kind.old_names
        ]
        for name, item in names:
            found.append(
                inspect.Parameter(
                    name, inspect.Parameter.KEYWORD_ONLY, default=item.default, annotation=hints[item.name]
                )
            )
    return found


def setting_defaults(declared: Mapping[str, type] = DECLARED) -> dict[str, Any]:
    """Every setting's default, by the module's name, in the signature's order."""
    return {setting_name(item): item.default for _, item in declared_fields(declared)}


def settings_signature(
    after: Mapping[str, tuple[str, ...]], declared: Mapping[str, type] = DECLARED
) -> Callable[[F], F]:
    """Give ``__init__(self, <objects>, **settings)`` the signature of its objects and every
    declared setting: its positional objects first, then each group's settings, a keyword-only
    object after the group ``after`` names for it."""

    def decorate(init: F) -> F:
        own = inspect.signature(init, eval_str=True)
        explicit = {name: p for name, p in own.parameters.items() if p.kind is not p.VAR_KEYWORD}
        placed = {name for names in after.values() for name in names}
        parameters = [p for name, p in explicit.items() if name not in placed]
        for group, kind in declared.items():
            parameters += setting_parameters({group: kind})
            parameters += [explicit[name] for name in after.get(group, ())]
        init.__signature__ = own.replace(parameters=parameters)  # type: ignore[attr-defined]
        return init

    return decorate


def bound_settings(
    owner: str, given: Mapping[str, Any], declared: Mapping[str, type] = DECLARED
) -> dict[str, Any]:
    """Every setting's value: ``given``'s, else its default; Python's TypeError for a keyword that
    names no setting."""
    defaults = setting_defaults(declared)
    for name in given:
        if name not in defaults:
            raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {name!r}")
    return {**defaults, **given}


def settings_args(declared: Mapping[str, type] = DECLARED, width: int = 100) -> str:
    """Each setting's help as a docstring's ``Args:`` entries (indented for a class body)."""
    entries = [
        textwrap.fill(
            f"{name}: {text}",
            width,
            initial_indent=" " * 8,
            subsequent_indent=" " * 12,
            break_on_hyphens=False,
        )
        for name, text in setting_help(declared).items()
    ]
    return "\n".join(entries)


def documented_settings(cls: T, declared: Mapping[str, type] = DECLARED) -> T:
    """Add every setting's help to the ``Args:`` that ends ``cls``'s docstring."""
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + settings_args(declared) + "\n    "
    return cls


def documented(cls: type) -> dict[str, str]:
    """Each argument's text in the ``Args:`` part of ``cls``'s docstring, as one line of markdown."""
    found: dict[str, str] = {}
    name = None
    lines = (inspect.getdoc(cls) or "").splitlines()
    for line in lines[lines.index("Args:") + 1 :]:
        if line and not line.startswith(" "):  # the next part of the docstring
            break
        head = line[4:].split(":", 1)
        if not line.startswith("     ") and len(head) == 2 and head[0].isidentifier():
            name, found[head[0]] = head[0], head[1].strip()
        elif name is not None and line.strip():
            found[name] += " " + line.strip()
    return {key: text.replace("``", "`").replace("|", "\\|") for key, text in found.items()}


def shown(default: Any) -> str:
    """A default as the settings table shows it."""
    if default is inspect.Parameter.empty:
        return "required"
    if callable(default):
        return f"`{default.__module__}.{default.__qualname__}`"
    return f"`{default!r}`"


def settings_table(cls: type, group: str) -> str:
    """A markdown table of ``cls``'s arguments (for the module: its objects, then every declared
    setting): the flag (``--<group>.<name>``), its default, its help from the docstring."""
    texts = documented(cls)
    rows = ["| flag | default | what |", "|---|---|---|"]
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        if name != "self":
            rows.append(f"| `--{group}.{name}` | {shown(parameter.default)} | {texts.get(name, '')} |")
    return "\n".join(rows)


def save_settings(
    module: Any,
    init: Callable[..., Any],
    objects: Mapping[str, Any],
    given: Mapping[str, Any],
    ignore: list[str],
) -> None:
    """``module.save_hyperparameters`` of ``objects`` (as plain data) and every setting (``given``'s,
    else its default; Python's TypeError for a keyword that names none), in ``init``'s signature's
    order, less ``ignore``: what LightningCLI gives, where it gives them
    (its ``_instantiator`` with them), else these. Lightning reads an ``__init__``'s frame for its
    arguments, which a ``**settings`` frame does not hold by name. A former name is saved as the
    setting it became."""
    renamed = current_names(given)
    values = {**objects, **bound_settings(type(module).__name__, renamed)}
    order = [name for name in inspect.signature(init).parameters if name in values]
    if not given_by_cli():  # given here: else Lightning walks the callers' frames for an __init__'s
        with given_hyperparameters({name: values[name] for name in order}):
            module.save_hyperparameters(ignore=list(ignore))
        module._hparams_name = None  # as a dict of them saved: loaded back as keywords
        return
    old = [name for name in given if name not in renamed]
    module.save_hyperparameters(ignore=[*ignore, *old])
    missing = {name: values[name] for name in order if name not in module.hparams and name not in ignore}
    moved = {name: value for name, value in renamed.items() if name in given and value is not given[name]}
    if missing or moved:
        module.save_hyperparameters({**missing, **moved})


def given_by_cli() -> bool:
    """Whether LightningCLI's instantiator is giving the module its hyperparameters now (Lightning's
    private ``_given_hyperparameters``)."""
    from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters

    return _given_hyperparameters.get() is not None


@contextlib.contextmanager
def given_hyperparameters(values: dict[str, Any]) -> Iterator[None]:
    """Give ``save_hyperparameters`` ``values`` as LightningCLI gives its own (no ``_instantiator``):
    Lightning then reads no frame, where 2.4 fails on a caller's that uses ``super()``."""
    from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters

    token = _given_hyperparameters.set(values)
    try:
        yield
    finally:
        _given_hyperparameters.reset(token)
