"""A typed tool with a Google-style docstring, defaults and a Literal, shared by the tools tests."""

from __future__ import annotations

from typing import Literal

from longstraw_agents.tools import tool


@tool
def lookup(city: str, limit: int = 3, units: Literal["metric", "imperial"] = "metric") -> str:
    """Look up the weather of a city.

    A second paragraph of the description.

    Args:
        city (str): The city's name,
            as written on a map.
        limit: How many days to forecast.
        units: The unit system.

    Returns:
        A forecast.
    """
    return f"{city}:{limit}:{units}"
