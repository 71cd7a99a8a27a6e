"""``python -m bench.pipeline``: see ``bench/pipeline/run.py``."""

from bench.pipeline.run import main

main()
