"""``python -m bench.host_step``: see ``bench/host_step/run.py``."""

from bench.host_step.run import main

main()
