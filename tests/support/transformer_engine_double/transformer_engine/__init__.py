"""TransformerEngine DOUBLE (test support): see ../README.md. Not the real package.

Only what Megatron-Bridge 0.3.1 needs at import; every callable raises NotImplementedError."""

IS_DOUBLE = True
__version__ = "0.0.0+double"


class DoubleNotImplemented(NotImplementedError):
    """Raised by every entry point of the double: real TransformerEngine code would run here."""

    def __init__(self, name: str):
        super().__init__(f"transformer_engine.{name} is a test double (TransformerEngine is not installed on this "
                         "machine); models built with Megatron-Core's local layers never call it")
