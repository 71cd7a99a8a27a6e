"""``python -m nxd_hf``: the ``nxd-hf`` command."""

import sys

from nxd_hf.cli import main

sys.exit(main())
