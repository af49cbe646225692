"""``python -m bench.vs_trl``: whole runs of both sides (:mod:`bench.vs_trl.run`)."""

from bench.vs_trl.run import main

main()
