"""``python -m bench.fused_loss``: see ``bench/fused_loss/run.py``."""

from bench.fused_loss.run import main

main()
