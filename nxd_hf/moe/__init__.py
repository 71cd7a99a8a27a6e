"""Mixture-of-experts: experts sharded over TP (``tp_experts``)."""
