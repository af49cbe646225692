"""areal-mega: asynchronous reinforcement learning for LLMs on Megatron-Core."""

__version__ = "0.1.0"
