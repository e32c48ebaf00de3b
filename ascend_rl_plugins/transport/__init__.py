"""Transports that carry bytes and tensors between processes on different hosts, below the
features (a feature must not import another feature's modules; a transport is shared).

Modules: :mod:`.mooncake_store` (a client of Mooncake Store: one ``mooncake_master``, every
process a client, objects in the memory the clients lend to the store).

Nothing here is imported by the plugin, and the modules import their libraries (``mooncake``)
only when a client connects: importing the package stays cheap and works where the library is
not installed.
"""
