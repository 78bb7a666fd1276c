"""A user's agent written against the OpenAI SDK as the episode runner: the policy served on a
local OpenAI-compatible endpoint (endpoint.py), the calls of each episode recorded in token ids and
chained (episodes.py), each episode one completion of the Rollout (assemble.py), the agents run
and their calls sampled (runner.py)."""

from forge_lightning.rollout.agents.assemble import AgentOutcome
from forge_lightning.rollout.agents.endpoint import AgentEndpoint
from forge_lightning.rollout.agents.episodes import Chain, EpisodeLog
from forge_lightning.rollout.agents.runner import AgentRunner, load_agent

__all__ = ["AgentEndpoint", "AgentOutcome", "AgentRunner", "Chain", "EpisodeLog", "load_agent"]
