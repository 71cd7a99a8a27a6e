"""Mixture-of-experts support: experts sharded over TP (``tp_experts``), the load-balancing loss
across stages and replicas (``aux_loss``)."""
