"""Double of ``mindspeed.core.context_parallel.ring_context_parallel``."""
