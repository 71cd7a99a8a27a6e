"""``python -m bench.checkpoint``: see ``bench/checkpoint/run.py``."""

from bench.checkpoint.run import main

main()
