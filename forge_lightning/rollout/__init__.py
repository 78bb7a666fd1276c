"""Prompts in, a :class:`~forge_lightning.rollout.types.Rollout` out: the rollout type (types.py),
the sampler (sampler.py), the sources that decide when and where a batch is sampled (sources.py),
the tool-using sampler (tool_sampler.py) with its tools (tools/), the log-probs of a rollout under
a model (logprobs.py), and the engines that sample (engines/)."""

from forge_lightning._moved import lazy_exports

# The names of the module this package replaced, imported on first use.
__getattr__, __dir__ = lazy_exports(
    __name__,
    (
        "forge_lightning.rollout.types",
        "forge_lightning.rollout.sampler",
        "forge_lightning.rollout.engines.base",
        "forge_lightning.rollout.control_tokens",
    ),
)
