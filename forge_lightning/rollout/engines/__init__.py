"""The engines that sample: their request, result and capabilities (base.py), HF ``generate``
(hf.py), vLLM (vllm.py), a low-precision copy (quantized.py), chosen by name (registry.py); the
adapter of engines written to the old five-argument ``generate`` (legacy.py); the checks of
engine-specific settings (generation_settings.py), and the weight ring the asynchronous rollout
worker (rollout/async_worker.py, above the episode runners it runs) reads (weight_ring.py).

Nothing here imports the rest of ``rollout/`` but its shared types (rollout/types.py)."""

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
