"""Mixture-of-experts parallelism: expert parallelism (``ep_dispatch``)."""
