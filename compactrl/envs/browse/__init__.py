"""An offline multi-hop browsing env over a generated fictional world (see env.py for the tools)."""

from compactrl.envs.browse.env import SYSTEM, BrowseEnv, parse_call
from compactrl.envs.browse.questions import Question, normalise

__all__ = ["SYSTEM", "BrowseEnv", "Question", "normalise", "parse_call"]
