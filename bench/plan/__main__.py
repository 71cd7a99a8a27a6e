"""``python -m bench.plan``: see ``bench/plan/run.py``."""

from bench.plan.run import main

main()
