"""The trainer's parts: the session (mesh, engines, resume, intake, logging), step planning and
distribution (:mod:`.batches`), the trajectory intake, weight publishing to the rollout servers
(:mod:`.weight_sender`, :mod:`.weights`), the critic step, SFT and evaluation scheduling. The
loop itself is :mod:`areal_mega.trainer`."""
