"""Tensor-parallel layouts of any ``nn.Module``, derived from its torch.fx graph traced on dummy
inputs (``derive``: column/row pairs, attention split by heads, embeddings by vocabulary; exact,
or replicated where no exact split exists), and their application to the module (``apply``).
Used by ``nxd_hf.nnscaler`` and by the config API for a plain PyTorch module at tp > 1."""
