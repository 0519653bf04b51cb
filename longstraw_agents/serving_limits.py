"""Moved to ``longstraw_agents.serving.limits``; this module keeps the old imports working
(``from longstraw_agents.serving_limits import ServingLimits``)."""

from longstraw_agents.serving.limits import *  # noqa: F403
