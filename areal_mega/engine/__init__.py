"""Megatron-core training/inference engine (actor and reference)."""
from areal_mega.engine.megatron_engine import MegatronEngine, default_denominator

__all__ = ["MegatronEngine", "default_denominator"]
