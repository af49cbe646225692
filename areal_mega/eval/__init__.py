"""Evaluation: ``python -m areal_mega.eval`` (see ``__main__``), the generation runner
(:mod:`areal_mega.eval.runner`) and the pure scores (:mod:`areal_mega.eval.scores`: unbiased
pass@k, per-source summaries). Evaluation during training is driven by the trainer
(:mod:`areal_mega.train.evaluation`) and run by the rollout worker
(:mod:`areal_mega.eval.worker_hook`)."""
