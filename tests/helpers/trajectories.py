"""Deterministic trajectories for data-plane tests (regenerated on both ends of a socket)."""

import numpy as np

from areal_mega.dataplane import Trajectory


def make_traj(sender: int, i: int, max_len: int = 300) -> Trajectory:
    """Trajectory number ``i`` of ``sender``: random lengths, values, extras; reproducible."""
    rng = np.random.default_rng(sender * 100_003 + i)
    n_p, n_g = int(rng.integers(1, max_len // 2)), int(rng.integers(1, max_len // 2))
    extras = {}
    if i % 3 == 0:
        extras["ref_logprobs"] = -rng.random(n_p + n_g).astype(np.float32)
    if i % 5 == 0:
        extras["values"] = rng.standard_normal(n_p + n_g)  # float64 extra
    t = Trajectory.from_tokens(
        rng.integers(0, 50_000, n_p),
        rng.integers(0, 50_000, n_g),
        -rng.random(n_g) * 5,
        rng.integers(0, 7, n_g),
        reward=float(rng.standard_normal()),
        sample_id=f"w{sender}-{i}",
        group_id=f"w{sender}-g{i // 4}",
        finish_reason=("stop", "length", "abort")[i % 3],
        server_id=f"srv{sender}",
        created_at=1000.0 + i + sender / 10,
        meta={"step": i, "tags": ["a", sender]},
        token_extras=extras,
    )
    if i % 7 == 0:
        t.reward = rng.standard_normal(t.length).astype(np.float32)
    return t
