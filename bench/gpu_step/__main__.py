"""``python -m bench.gpu_step``: see ``bench/gpu_step/run.py``."""

from bench.gpu_step.run import main

main()
