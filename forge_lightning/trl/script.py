"""The tools and environment factories a TRL script defines in itself (``__main__``), by a path of
this module: the module stores tools by import path (rollout/tools/stored.py), and a script's own
functions have none. ``GRPOTrainer`` puts a stand-in for each here, under its name, in the process
that runs the script; the script run again (a resume) puts them back. Another process that did not
run the script (``load_from_checkpoint``, the CLI on the saved config, a worker process) cannot
import them, and is told why.

Rewards need none of this: one without an import path is kept by value and left out of the
checkpoint (load_from_checkpoint then asks for ``reward=``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

_STAND_INS: dict[str, Any] = {}  # name -> the stand-in this process made


def by_path(obj: Any) -> Any:
    """``obj``, or for a function or class defined at the top level of ``__main__``, its stand-in
    here: a function calling it (its name, signature, docstring and type hints), or a subclass."""
    qualname = getattr(obj, "__qualname__", "")
    if getattr(obj, "__module__", None) != "__main__" or not qualname.isidentifier():
        return obj  # importable already, or refused by the module (a lambda, a local function)
    if qualname in globals():
        raise ValueError(
            f"{qualname!r} is a name of forge_lightning.trl.script itself: rename the script's one"
        )
    if inspect.isclass(obj):
        stand_in = type(obj.__name__, (obj,), {"__module__": __name__, "__qualname__": qualname})
    else:

        @functools.wraps(obj)
        def stand_in(*args: Any, **kwargs: Any) -> Any:
            return obj(*args, **kwargs)

        stand_in.__module__ = __name__
    _STAND_INS[qualname] = stand_in
    return stand_in


def __getattr__(name: str) -> Any:
    if name in _STAND_INS:
        return _STAND_INS[name]
    raise AttributeError(
        f"forge_lightning.trl.script.{name} is a function of a TRL script (its __main__), which "
        "forge_lightning.trl.GRPOTrainer makes importable in the process that runs the script; this "
        "process did not run it. Run the script (a resume: trainer.train(resume_from_checkpoint=True)), "
        "or define the function in a module and import it there"
    )
