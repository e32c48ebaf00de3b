"""Test support: child-process scenarios, reference-stack lookup, and (later) harnesses.

Nothing here is part of the product; it is imported only by tests and by the scenario
modules that tests run in fresh interpreters.
"""
