"""What a run reports: each step's metrics (metrics.py, reporter.py), phase timings (profiler.py),
and the curves of a log (plot.py)."""

from forge_lightning._moved import lazy_exports

# The names of the module this package replaced, imported on first use.
__getattr__, __dir__ = lazy_exports(
    __name__,
    (
        "forge_lightning.reporting.reporter",
        "forge_lightning.reporting.metrics",
        "forge_lightning.reporting.profiler",
    ),
)
