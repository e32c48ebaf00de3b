"""Tools for tests, benchmarks and the CPU demo (never imported by the plugin itself)."""
