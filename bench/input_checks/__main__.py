"""``python -m bench.input_checks``: see ``bench/input_checks/run.py``."""

from bench.input_checks.run import main

main()
