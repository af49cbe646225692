"""ZMQ data plane: trajectories from rollout workers to the trainer, and the control channel.

* :mod:`.trajectory` — :class:`Trajectory`, the unit (numpy arrays + metadata);
  ``validate()`` names bad fields.
* :mod:`.multimodal` — a trajectory's images (``Trajectory.multimodal``), :class:`VisionSpec`
  and the checks of the images against the tokens and the receiving model.
* :mod:`.wire` — :func:`encode_trajectory` / :func:`decode_trajectory`, the wire format
  (msgpack header, small tensors packed in one frame, one zero-copy frame per large tensor,
  schema version, optional HMAC), :class:`WireError` with a reason.
* :mod:`.transport` — :class:`TrajectorySender` (rollout, DEALER) /
  :class:`TrajectoryReceiver` (trainer, ROUTER), acks as backpressure.
* :mod:`.buffer` — :class:`TrajectoryBuffer`: dedup, oldest-first prompt groups, atomic
  save / load.
* :mod:`.journal` — the write-ahead journal of accepted trajectories: fsync'd, checksummed
  segments, and which ones a checkpoint still needs.
* :mod:`.prompt_ledger` — which prompts the trainer has durably accepted, and where a resumed
  rollout starts.
* :mod:`.control` — the trainer <-> rollout worker control channel (JSON over ZMQ REQ/REP,
  signed when a secret is set).
"""

from areal_mega.dataplane.buffer import BufferFileError, TrajectoryBuffer
from areal_mega.dataplane.multimodal import VisionSpec
from areal_mega.dataplane.trajectory import (
    FINISH_REASONS,
    Trajectory,
    TrajectoryError,
)
from areal_mega.dataplane.transport import (
    DataplaneError,
    TrajectoryReceiver,
    TrajectorySender,
    check_endpoint,
    default_endpoint,
)
from areal_mega.dataplane.wire import (
    REJECT_REASONS,
    SCHEMA_VERSION,
    WireError,
    decode_trajectory,
    encode_trajectory,
)

__all__ = [
    "BufferFileError",
    "TrajectoryBuffer",
    "FINISH_REASONS",
    "VisionSpec",
    "Trajectory",
    "TrajectoryError",
    "DataplaneError",
    "TrajectoryReceiver",
    "TrajectorySender",
    "check_endpoint",
    "default_endpoint",
    "REJECT_REASONS",
    "SCHEMA_VERSION",
    "WireError",
    "decode_trajectory",
    "encode_trajectory",
]
