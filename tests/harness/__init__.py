"""Tests of the test-support harnesses themselves (tests/support/megatron.py)."""
