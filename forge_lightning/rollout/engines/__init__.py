"""The engines that sample: their protocols (base.py), HF ``generate`` (hf.py), vLLM (vllm.py),
chosen by name (registry.py); the checks of engine-specific settings (generation_settings.py), and
the asynchronous rollout worker (async_worker.py) with the weight ring it reads (weight_ring.py)."""

from forge_lightning._moved import lazy_exports

# The names of the module this package replaced, imported on first use.
__getattr__, __dir__ = lazy_exports(
    __name__,
    (
        "forge_lightning.rollout.engines.hf",
        "forge_lightning.rollout.engines.base",
        "forge_lightning.rollout.engines.registry",
    ),
)
