"""Mixture-of-experts support: experts sharded over TP (``tp_experts``), expert parallelism
(``ep_dispatch``), the load-balancing loss across stages and replicas (``aux_loss``)."""
