"""Imported last by the test forkserver (``nxd_hf.testing``'s preload list): everything the
forkserver imported moves to the garbage collector's permanent generation, so the ranks it forks
do not traverse those hundreds of thousands of objects on every full collection (transformers'
``Trainer.train`` runs ``gc.collect()`` through accelerate's ``free_memory``: 0.2 s each time
otherwise)."""

import gc

gc.freeze()
