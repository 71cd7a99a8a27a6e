"""Where the checkout's folders are, for tests that read the repository's files (examples, docs,
pyproject.toml) wherever their own file sits below tests/."""

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
EXAMPLES = REPO / "examples"
