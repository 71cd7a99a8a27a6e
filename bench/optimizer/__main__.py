"""``python -m bench.optimizer``: see ``bench/optimizer/run.py``."""

from bench.optimizer.run import main

main()
