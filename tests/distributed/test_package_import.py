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
