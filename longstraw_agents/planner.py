"""Moved to ``longstraw_agents.plan`` (the memory planner is ``plan.planner`` and the modules beside it); this module
keeps the old imports working (``from longstraw_agents.planner import PlanRequest, plan_memory``)."""

from longstraw_agents.plan.configs import *  # noqa: F403
from longstraw_agents.plan.growing import *  # noqa: F403
from longstraw_agents.plan.memory_plan import *  # noqa: F403
from longstraw_agents.plan.parameters import *  # noqa: F403
from longstraw_agents.plan.planner import *  # noqa: F403
from longstraw_agents.plan.probes import *  # noqa: F403
from longstraw_agents.plan.request import *  # noqa: F403
