"""nxd_hf.lightning (NeuronLTModule, NxDStrategy, the progress bar and TensorBoard logger) against
plain PyTorch Lightning in one process on the same tiny Llama, data and seed: logged losses every
step, validation loss, final parameters, the logger's event file and the progress bar (one rank
writes), at tp=2, pp=2 and dp=2 with ZeRO-1; a checkpoint saved at tp=2 resumed at tp=1 x dp=2."""

import pytest

import lightning_cases


@pytest.mark.parametrize("tp, pp, zero1", [(2, 1, False), (1, 2, False), (1, 1, True)], ids=["tp2", "pp2", "dp2-zero1"])
def test_lightning_parity(ranks2, tmp_path, tp, pp, zero1):
    ranks2.run(lightning_cases.check_parity, str(tmp_path), tp, pp, zero1)


def test_lightning_checkpoint_resumes_resharded(ranks2, tmp_path):
    ranks2.run(lightning_cases.check_resume_resharded, str(tmp_path))
