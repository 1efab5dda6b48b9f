"""The test suite; a package so that its helpers import as `tests.helpers.*` wherever the repository root is on the
path."""
