"""``python -m bench.memory``: see ``bench/memory/run.py``."""

from bench.memory.run import main

main()
