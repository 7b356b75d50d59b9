"""Agents for rlc's agentic rollouts, and the `llm` handle every agent receives.

An agent is `run(task, llm)`: ordinary code that talks to an OpenAI-compatible endpoint. It gets everything it
needs through `llm` (`Endpoint`): the base URL of the rollout engine serving its trajectory, the trajectory's
session key as the API key, the served model name, and helpers for the `openai` client and litellm. Nothing
here imports rlc's runtime, so agents stay plain programs.
"""

from rlc.agents.llm import Endpoint

__all__ = ["Endpoint"]
