"""``python -m bench.moe``: see ``bench/moe/run.py``."""

from bench.moe.run import main

main()
