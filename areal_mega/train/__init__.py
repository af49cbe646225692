"""The trainer's parts; the loop itself is :mod:`areal_mega.trainer`.

- :mod:`.session` — what a trainer process holds across steps: mesh, engines, intake, logger,
  resume;
- :mod:`.intake` — ZMQ receiver -> write-ahead journal -> buffer (rank 0);
- :mod:`.batches` — the step planned on rank 0, each DP rank's share of packed micro-batches;
- :mod:`.weights` — the actor's weights written as an HF directory (disk weight updates);
- :mod:`.weight_sender` — the distributed weight update: bucket planning and the sender;
- :mod:`.critic_step` — the critic's part of a step and of the session;
- :mod:`.teacher` — on-policy distillation in the step and the session;
- :mod:`.routing` — the routing-replay metrics of a step;
- :mod:`.evaluation` — evaluation during training, the trainer's side;
- :mod:`.screen` — entry checks of the numbers a sample brings from outside (rewards, rollout
  logprobs, MoE routes, teacher logprobs);
- :mod:`.nonfinite` — skipped non-finite steps: their metrics, their likely source, the stop
  after ``actor.max_consecutive_skips`` in a row;
- :mod:`.quarantine` — samples the trainer died on twice, kept out of training;
- :mod:`.sft` — supervised fine-tuning on the same engine.
"""
