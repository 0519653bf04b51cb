"""Moved to ``longstraw_agents.plan`` (the time model is ``plan.timing`` and the modules beside it); this module keeps
the old imports working (``from longstraw_agents.timing import PROFILES, step_time``)."""

from longstraw_agents.plan.hardware import *  # noqa: F403
from longstraw_agents.plan.phases import *  # noqa: F403
from longstraw_agents.plan.timing import *  # noqa: F403
from longstraw_agents.plan.work import *  # noqa: F403
