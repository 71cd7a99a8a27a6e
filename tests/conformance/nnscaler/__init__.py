"""nnScaler's own tests (microsoft/nnscaler, MIT licence: LICENSE) run against nxd_hf.nnscaler.

``parallel_module/`` holds the tests of nnScaler's ``tests/parallel_module/`` whose subject is in the
reference document, with only their imports and CUDA/NCCL lines changed (each file says what);
this folder mirrors nnScaler's ``tests/`` so their relative imports (``..launch_torchrun``,
``..utils``) stay as they are. Which tests are not here, and why: docs/nnscaler.md.
"""
