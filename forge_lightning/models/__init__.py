"""The policy model: a model spec loaded offline (loading.py), LoRA adapters (lora.py), FSDP2
sharding (sharding.py), the model made ready for training (policy.py), and transformers' renames
(hf_compat.py)."""

from forge_lightning._moved import lazy_exports

# The names of the module this package replaced, imported on first use.
__getattr__, __dir__ = lazy_exports(
    __name__,
    ("forge_lightning.models.loading",),
)
