"""ZMQ data plane: trajectories from rollout workers to the trainer.

Public API: :class:`Trajectory` (the unit), :class:`TrajectoryError`.
"""
from areal_mega.dataplane.trajectory import (FINISH_REASONS, Trajectory,  # noqa: F401
                                             TrajectoryError)
