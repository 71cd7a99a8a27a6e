"""``python -m bench.fsdp``: see ``bench/fsdp/run.py``."""

from bench.fsdp.run import main

main()
