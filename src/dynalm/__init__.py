"""DynaLM: an LLM inference engine for the CPU, written in Python."""

__version__ = "0.1.0"
