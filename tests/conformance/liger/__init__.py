"""Liger-Kernel's own test of its fused linear cross-entropy (linkedin/Liger-Kernel, BSD
2-clause licence: LICENSE) run against nxd_hf's ``fused_linear_cross_entropy``.

``test_fused_linear_cross_entropy.py`` is Liger's ``test/transformers/`` file with its imports
changed (the file says what else): Liger's API is ``liger_api.py``, written here on top of
nxd_hf's function; ``utils.py`` holds the helpers it imports from Liger's ``test/``. Every case
runs twice, with torch's ops and with nxd_hf's Triton kernels (in Triton's interpreter on a CPU;
``conftest.py``). What nxd_hf's loss does not have (class weights, Liger's z-loss, per-token
reduction: HF's causal-LM loss uses none of them) skips the case that asks for it.
"""
