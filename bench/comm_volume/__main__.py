"""``python -m bench.comm_volume``: see ``bench/comm_volume/run.py``."""

from bench.comm_volume.run import main

main()
