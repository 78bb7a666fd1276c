"""Rewards: the reward library (library.py), the call contract (calls.py), a trained reward model
(reward_model.py), math-verify answers (math_verify_reward.py), an environment's score
(environment.py), a scorer over HTTP (remote.py), an LLM judge (judge.py), the HTTP both use
(http.py), credit for a worked solution's steps (intermediate.py), what a resume may change of a
reward (resume_changes.py) and the scoring of a batch (batch_scoring.py).

The library's names are offered here, the import path configs and checkpoints use
(``forge_lightning.rewards.CompositeReward``)."""

from forge_lightning._moved import lazy_exports

# The names of the module this package replaced, imported on first use.
__getattr__, __dir__ = lazy_exports(
    __name__,
    (
        "forge_lightning.rewards.library",
        "forge_lightning.rewards.calls",
        "forge_lightning.run.user_code",
        "forge_lightning.rewards.environment",
        "forge_lightning.rewards.math_verify_reward",
        "forge_lightning.rewards.remote",
        "forge_lightning.rewards.judge",
        "forge_lightning.rewards.intermediate",
    ),
)
