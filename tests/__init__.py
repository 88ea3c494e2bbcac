"""pyml's test suite, by area; what several areas share is in tests/support/ and tests/conftest.py."""
