"""``python -m bench.lora``: see ``bench/lora/run.py``."""

from bench.lora.run import main

main()
