"""servesim: replay LLM-serving request traces through scheduling policies."""

from sim.errors import ServesimError

__all__ = ["ServesimError"]
__version__ = "0.1.0"
