"""One module per feature. Each owns its algorithm, its flags and its patches; the plugin
loader imports every module here, so adding a feature means adding a module."""


def modules_with(attribute: str) -> list[tuple[str, object]]:
    """``(feature name, module.attribute)`` of every feature package that defines ``attribute``
    (the CLI's ``register_cli``, the self-test's ``selftest_checks``), in name order."""
    import importlib
    import pkgutil
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        value = getattr(importlib.import_module(f"{__name__}.{info.name}"), attribute, None)
        if value is not None:
            found.append((info.name, value))
    return found
