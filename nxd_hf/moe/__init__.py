"""Mixture-of-experts support: the load-balancing loss across stages and replicas
(``aux_loss``)."""
