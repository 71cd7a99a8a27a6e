"""Setup guards: checks that make every rank stop with the same ValueError instead of a hang or
a silent wrong result (``fail_together`` around setup steps, the first-step ``input_check``)."""
