"""``python -m forge_lightning.bench``: the throughput benchmark (throughput.py) and the two
references each timed step is measured against (references.py); ``python -m
forge_lightning.bench.sandbox_cost``: what ``sandbox: process`` costs a call (sandbox_cost.py)."""

from forge_lightning._moved import lazy_exports

# The names of the module this package replaced, imported on first use.
__getattr__, __dir__ = lazy_exports(
    __name__,
    ("forge_lightning.bench.throughput",),
)
