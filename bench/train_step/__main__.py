"""``python -m bench.train_step``: see ``bench/train_step/run.py``."""

from bench.train_step.run import main

main()
