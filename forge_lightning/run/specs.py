"""Objects as plain data, the way a config names them, so that a checkpoint can store them.

Lightning loads a checkpoint's hyperparameters with ``weights_only=True``, which refuses anything
but plain dicts, lists, strings and numbers. :func:`to_spec` writes an object in the form a
LightningCLI config uses for it, and :func:`from_spec` builds the object back:

- a function or class: its import path, ``"module.qualname"``;
- an instance: ``{"class_path": "module.Qualname", "init_args": {name: spec, ...}}``, its
  ``__init__`` arguments read from the attributes of the same names;
- a list or tuple: the list of its items' specs; a dict: the dict of its values' specs;
- ``None``, a bool, a number or a string: itself.
"""

from __future__ import annotations

import copy
import importlib
import inspect
from typing import Any, TypeAlias

from forge_lightning._moved import PACKAGES_OF_OLD_MODULES

Spec: TypeAlias = "str | int | float | bool | None | list[Spec] | dict[str, Spec]"

_PLAIN = (str, int, float, bool, type(None))


class _NotStorable(Exception):
    """Raised inside :func:`to_spec` where an object has no plain-data form."""


def to_spec(obj: Any) -> Spec:
    """``obj`` as plain data (see the module docstring), or None when it has none: a lambda, a local
    function, one defined in ``__main__`` (a script or notebook, which another process cannot
    import), or an instance whose ``__init__`` arguments are not all attributes of it."""
    try:
        return _spec(obj)
    except _NotStorable:
        return None


def from_spec(spec: Spec, typehint: Any = Any) -> Any:
    """The object ``spec`` describes, read as a value of ``typehint`` the way LightningCLI reads a
    config (jsonargparse): with ``Callable`` an import path is the function it names, a
    ``class_path`` dict is an instance, its init args read against the class's own annotations
    (so a string stays a string where the class takes one). ValueError when it cannot be built."""
    # Here, not at the top: the package's GPU check runs where jsonargparse (the CLI's) is not.
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--value", type=typehint)
    try:
        config = parser.parse_object({"value": copy.deepcopy(spec)})  # it fills lists in place
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # < 4.49
        return instantiate(config).value
    except Exception as err:  # jsonargparse's errors, or the object's own __init__
        raise ValueError(f"cannot build an object from its stored form {spec!r}: {err}") from err


def is_spec(value: Any) -> bool:
    """Whether ``value`` is plain data (what :func:`to_spec` returns), not a live object."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, list):
        return all(is_spec(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and is_spec(item) for key, item in value.items())
    return False


def import_path(obj: Any) -> str | None:
    """``module.qualname`` of a function or class when importing it gives back ``obj`` itself."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or module == "__main__":
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):  # "<locals>" and "<lambda>" are no attributes
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    if found is not obj:
        return None
    return f"{_public_module(module, qualname, obj)}.{qualname}"


def _public_module(module: str, qualname: str, obj: Any) -> str:
    """The package above ``module`` when it replaced a module of the flat layout and offers ``obj``
    under the same name (the library's rewards: ``forge_lightning.rewards.CompositeReward``, the
    path configs and checkpoints have always used), else ``module``."""
    package = module.rpartition(".")[0]
    if "." not in qualname and package in PACKAGES_OF_OLD_MODULES:
        if getattr(importlib.import_module(package), qualname, None) is obj:
            return package
    return module


def canonical(spec: Spec) -> Spec:
    """``spec`` with each import path of this package as where its object is defined: two specs
    that name the same objects by an old and a new path (a checkpoint written before a module
    moved) are then equal."""
    if isinstance(spec, list):
        return [canonical(item) for item in spec]
    if isinstance(spec, dict):
        return {key: canonical(value) for key, value in spec.items()}
    if isinstance(spec, str) and spec.startswith("forge_lightning.") and " " not in spec:
        module, _, name = spec.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return spec
        defined = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        return f"{defined[0]}.{defined[1]}" if all(isinstance(d, str) for d in defined) else spec
    return spec


def _spec(obj: Any) -> Spec:
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, (list, tuple)):
        return [_spec(item) for item in obj]
    if isinstance(obj, dict) and all(isinstance(key, str) for key in obj):
        return {key: _spec(value) for key, value in obj.items()}
    if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj):
        path = import_path(obj)
        if path is None:
            raise _NotStorable(obj)
        return path
    return _instance_spec(obj)


def _instance_spec(obj: Any) -> dict[str, Spec]:
    cls = type(obj)
    path = import_path(cls)
    if path is None:
        raise _NotStorable(obj)
    if cls.__init__ is object.__init__:
        # No __init__ of its own: storable when nothing but the class makes the object (a tensor's
        # __new__ takes its data, and a stateless reward has no attributes).
        if cls.__new__ is not object.__new__ or getattr(obj, "__dict__", None):
            raise _NotStorable(obj)
        return {"class_path": path, "init_args": {}}
    if not inspect.isfunction(cls.__init__):  # a C type's __init__: its arguments are not known
        raise _NotStorable(obj)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # without self
    init_args: dict[str, Spec] = {}
    for param in params:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue  # what went there is not known
        if not hasattr(obj, param.name):
            raise _NotStorable(obj)
        init_args[param.name] = _spec(getattr(obj, param.name))
    return {"class_path": path, "init_args": init_args}
