"""Training objectives, one ``[objective]`` variant each, picked by ``objective.name``: ``rl``, ``rft``
and ``distill`` train on the run's own rollouts (:mod:`.rollouts`), ``sft`` on demonstrations
(:mod:`.sft`, also the warm-up of every run), ``sidequest`` on hindsight-labelled auxiliary-thread
samples (:mod:`.sidequest`). The loop calls them through :class:`.base.Objective`."""

from typing import Annotated

from pydantic import Field

from compactrl.rl.objectives.base import Objective, Run
from compactrl.rl.objectives.rollouts import RFT, RL, Distill, OnRollouts
from compactrl.rl.objectives.sft import SFT
from compactrl.rl.objectives.sidequest import SideQuest

ObjectiveConfig = Annotated[RL | RFT | Distill | SFT | SideQuest, Field(discriminator="name")]

__all__ = ["RFT", "RL", "SFT", "Distill", "Objective", "ObjectiveConfig", "OnRollouts", "Run", "SideQuest"]
