"""raykv: a distributed KV-cache service for LLM inference, built on Ray."""

__version__ = "0.1.0"
