"""``python -m bench.architectures``: see ``bench/architectures/run.py``."""

from bench.architectures.run import main

main()
