"""Helpers shared by several test files: model builders, reference runs, parity checks. Imported as
``support.<module>`` (tests/ is on sys.path, in pytest and in every rank a pool or spawn starts)."""
