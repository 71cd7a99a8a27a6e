"""Parity against the unparallelized model, as a library: ``check_parity`` (a user's config,
shrunk, on a layout: loss and every gradient), ``shrink_config`` and the pieces both build on
(``cases``: identical model pairs, a batch, gathered gradients, one case's agreed outcome)."""

from nxd_hf.parity.cases import ATOL, RTOL, CaseResult, build_pair, gathered_grad, make_batch, run_case
from nxd_hf.parity.check import check_parity
from nxd_hf.parity.shrink import shrink_config

__all__ = ["ATOL", "RTOL", "CaseResult", "build_pair", "check_parity", "gathered_grad", "make_batch", "run_case",
           "shrink_config"]
