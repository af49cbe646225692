"""GRPO on a CPU, ours against TRL's ``GRPOTrainer`` (TRL runs in its own ``.venv-trl``,
``make trl-env``).

- :mod:`.run` -- whole runs of both sides, side by side (``python -m bench.vs_trl``);
- :mod:`.seeds` -- several runs' reward curves pooled (``python -m bench.vs_trl.seeds``);
- :mod:`.step` -- one step of each on the same batch, tensor by tensor
  (``python -m bench.vs_trl.step``);
- :mod:`.quality` -- held-out quality against time; :mod:`.evaluate` -- the held-out
  evaluations of a run's weights (our evaluation CLI on one server); :mod:`.flops` -- model
  FLOPs, achieved FLOP/s and this machine's matmul peak; :mod:`.report` -- the table and the
  plot; :mod:`.machine` -- the pinned processes, their memory, the CPU;
- :mod:`.assets` -- the model with random weights, its tokenizer, the prompt files, the SFT
  warm start (both sides read the same ones);
- :mod:`.trl_side`, :mod:`.trl_step` -- TRL's side of a run and of a step, run by TRL's Python
  as ``-m bench.vs_trl.trl_side`` / ``-m bench.vs_trl.trl_step``.

Run from the repository root. Nothing is imported here: TRL's Python imports this package."""
