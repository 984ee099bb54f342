"""tether: one harness from experiment to production for long-horizon LLM agents."""

__version__ = "0.1.0"
