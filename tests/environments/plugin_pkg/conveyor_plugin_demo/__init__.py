"""A third-party game for Conveyor's plugin tests (installed by the tests with pip)."""
