"""Inspection tools: the scale health of a step."""
from scalify.inspect.health import EquationHealth, ScaleHealth, scale_health

__all__ = ["EquationHealth", "ScaleHealth", "scale_health"]
