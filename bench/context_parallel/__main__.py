"""``python -m bench.context_parallel``: see ``bench/context_parallel/run.py``."""

from bench.context_parallel.run import main

main()
