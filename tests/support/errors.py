"""What the error tests share: every rank raised the same error, and it says what it should."""

import re


def assert_same_error_on_every_rank(results: list[dict], case: str, pattern: str) -> None:
    """``results``: each rank's {case: the error message it raised}; every rank raised the same
    one, and it matches ``pattern``."""
    assert all(r[case] == results[0][case] for r in results), [r[case] for r in results]
    assert re.search(pattern, results[0][case], re.S), results[0][case]
