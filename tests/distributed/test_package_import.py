"""``import nxd_hf`` loads the library only: the spawn harness (``nxd_hf.testing``) and the parity
checks stay out until used, and ``nxd_hf.check_parity`` is the public ``nxd_hf.parity`` one."""

import subprocess
import sys

PROBE = """
import sys
import nxd_hf
print(sorted(m for m in sys.modules if m.startswith(("nxd_hf.testing", "nxd_hf.parity"))))
from nxd_hf.parity import check_parity
assert nxd_hf.check_parity is check_parity
print(sorted(m for m in sys.modules if m.startswith("nxd_hf.testing")))
"""


def test_import_nxd_hf_leaves_the_test_harness_out():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    after_import, after_check_parity = out.splitlines()
    assert after_import == "[]", f"import nxd_hf loaded {after_import}"
    assert after_check_parity == "[]", f"nxd_hf.check_parity loaded the spawn harness: {after_check_parity}"


WORLD_AT_EXIT = """
import atexit
import torch.distributed as dist
atexit.register(lambda: print("initialized at exit:", dist.is_initialized()))  # runs after nxd_hf's own
from nxd_hf import backend
backend.init_process_group_from_env()
print("initialized:", dist.is_initialized())
"""


def test_the_world_nxd_hf_started_is_destroyed_at_exit():
    """A script that leaves nxd_hf's world alive does not leave gloo's threads to C++ teardown
    (which aborted the nnScaler example under torchrun now and then)."""
    out = subprocess.run([sys.executable, "-c", WORLD_AT_EXIT], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["initialized: True", "initialized at exit: False"]
