"""Small models for demos and tests (random weights, CPU torch)."""

from raykv.models.tiny_decoder import TinyConfig, TinyDecoder

__all__ = ["TinyConfig", "TinyDecoder"]
