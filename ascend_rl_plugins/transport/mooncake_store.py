"""A thin client of Mooncake Store for byte objects and tensors, with Mooncake's rules built in.

Why Mooncake: it is the transfer engine vLLM-Ascend's disaggregated prefill/decode serving uses
(its Mooncake connectors); on Atlas A3 the ``mooncake-transfer-engine-npu`` wheel's ``ascend``
protocol moves device memory over HCCS/RDMA through CANN, and on x86-64 CPU hosts
``mooncake-transfer-engine-non-cuda`` moves host memory over TCP (or RDMA). One deployment
carries bytes between processes on different hosts: one ``mooncake_master`` (with its HTTP
metadata server), every process a client that lends part of its memory (its *segment*) to the
store. A put copies the object into some client's segment; any client reads it from there.

Deployment (flags of ``mooncake_master`` 0.3.13.post1)::

    mooncake_master --rpc_port=50051 --enable_http_metadata_server=true \\
        --http_metadata_server_port=8080 --metrics_port=9003 [--rpc_address=<ip>]

then ``master_address="<master ip>:50051"``, ``metadata_server="http://<master ip>:8080/
metadata"``, ``admin_url="http://<master ip>:9003"`` (the admin HTTP server that lists keys).
``--default_kv_lease_ttl`` (10000 ms) is the read lease below; ``--client_ttl`` (10 s) is how
long the master keeps a silent client's segment, and the objects in it, before dropping both.

The rules (each checked on 0.3.13.post1, TCP on loopback; :class:`MooncakeStore` applies them):

- A ``put`` on a key that exists returns 0 and keeps the **old** value. :meth:`MooncakeStore.put`
  refuses an existing key (:class:`KeyExistsError`) unless ``replace=True``, which upserts
  (bytes) or removes then puts (spans).
- ``get``, ``get_size``, ``is_exist`` grant the object a read lease (10 s); ``remove`` of a
  leased object fails (``OBJECT_HAS_LEASE``): removal here always forces.
- ``get`` returns ``b''`` for a missing object and for a failed transfer alike, and ``put``
  of a value larger than ``local_buffer_size`` fails: bytes travel here through
  ``put_from`` / ``get_into`` (no size limit but the segments'), after ``get_size``.
- An object lives in the segment of the client the master placed it on (by default any
  client's, at random). When that client dies, reads of the object fail (``TRANSFER_FAIL``)
  until ``client_ttl`` has passed, then the master drops the object. With ``replica_num=2``
  a reader reads the first replica the master lists, dead or not (no fallback), except a
  reader holding a replica itself, which reads its own. So an object that must outlive the
  process that put it goes to a **holder**: a process that only lends memory (``mooncake_client``,
  Mooncake's standalone client: :func:`holder_command`), named by ``holder_segment``. Mooncake
  silently places an object elsewhere when the preferred segment is absent or full: a put
  here checks where each object went and refuses (removing it) if not on the holder.
- Until ``client_ttl`` has passed, the master also keeps placing new objects on a dead
  client's segment, and those puts fail (``TRANSFER_FAIL``): another reason for writers to
  name a holder.
- Objects cannot be empty (``INVALID_PARAMS``); a put fails with ``NO_AVAILABLE_HANDLE`` when
  no segment has room (a client may lend nothing: ``segment_size=0``).
- ``local_hostname`` names the client and its segment (``host:port``; over ``tcp`` the port is
  a name only: the engine listens on ports of its own): a second client under a name in use
  is refused (``setup`` fails), so every process needs its own.
- Over ``tcp`` any host memory may be read or written directly, registered or not; over
  ``rdma`` / ``ascend`` Mooncake documents that the memory must be registered first
  (:meth:`MooncakeStore.register`, e.g. the paged KV caches once; not run here: no RDMA NIC
  or NPU), which ``tcp`` accepts too.
- The Python client cannot list keys; the master's admin HTTP server can (``/get_all_keys``):
  :meth:`MooncakeStore.keys` needs ``admin_url``. Removal by prefix needs no listing
  (``remove_by_regex``): :meth:`MooncakeStore.remove_prefix`.

Tensors travel as *spans* (address, byte count) of host memory: an object is the
concatenation of its spans, written and read without a staging copy
(``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``); the spans that read an
object need not cut it where the spans that wrote it did. :func:`block_spans` gives the spans of
a selection of blocks of a paged KV tensor, so an export reads the source's blocks in place and
a load writes the destination's blocks in place.

Importing this module imports neither ``mooncake`` nor torch: :meth:`MooncakeStore.connect` imports
``mooncake.store``.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

PROTOCOLS = ("tcp", "rdma", "ascend")
PIP_PACKAGES = {"x86-64 CPU hosts": "mooncake-transfer-engine-non-cuda",
                "Atlas A3 (ascend protocol)": "mooncake-transfer-engine-npu"}
VERIFIED_VERSION = "0.3.13.post1"   # the release whose behaviour the docstring above records

MiB = 1 << 20

# Mooncake's ErrorCode values (mooncake-store types.h) that its Python client returns
ERROR_NAMES = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS", -103: "CLIENT_NOT_FOUND", -200: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION", -400: "INVALID_KEY", -500: "WRITE_FAIL", -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT", -700: "INVALID_WRITE", -701: "INVALID_READ", -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED", -708: "OBJECT_HAS_REPLICATION_TASK",
    -710: "REPLICA_NOT_FOUND", -712: "REPLICA_IS_GONE", -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL", -901: "RPC_TIMEOUT", -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
}
OBJECT_NOT_FOUND = -704
NO_AVAILABLE_HANDLE = -200

Span = tuple[int, int]   # (address, byte count) of host memory (device memory over 'ascend')


def error_name(code: int) -> str:
    return ERROR_NAMES.get(code, f"error {code}")


class MooncakeUnavailable(RuntimeError):
    """Mooncake cannot be used here: the package or a library it needs is missing, or the
    master / metadata server named by the settings does not answer."""


class MooncakeError(RuntimeError):
    """An operation of the store failed: ``code`` is Mooncake's error code."""

    def __init__(self, operation: str, key: str | None, code: int, detail: str = ""):
        self.operation, self.key, self.code = operation, key, code
        where = f" {key!r}" if key is not None else ""
        super().__init__(f"mooncake {operation}{where}: {error_name(code)} ({code})"
                         + (f": {detail}" if detail else ""))


class KeyExistsError(MooncakeError):
    """A put named a key that exists: Mooncake would keep the old value and report success."""

    def __init__(self, operation: str, key: str):
        super().__init__(operation, key, -705,
                         "a put on an existing key keeps the old value; use a new key, or "
                         "replace=True (upsert)")


# -- settings ---------------------------------------------------------------------------------
def _host_port(name: str, value: Any, *, port_required: bool) -> None:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value) or "/" in value:
        raise ValueError(f"{name}={value!r}: accepted 'host:port'" + ("" if port_required else " or 'host'"))
    host, sep, port = value.rpartition(":")
    if not sep:
        if port_required:
            raise ValueError(f"{name}={value!r}: accepted 'host:port' (the port is missing)")
        return
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name}={value!r}: accepted 'host:port' with a port in 1..65535")


def _http_url(name: str, value: Any) -> None:
    parts = urllib.parse.urlsplit(value) if isinstance(value, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{name}={value!r}: accepted an http:// or https:// URL")


def _size(name: str, value: Any, minimum: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
        raise ValueError(f"{name}={value!r}: accepted an integer number of bytes >= {minimum}")


@dataclass(frozen=True)
class MooncakeSettings:
    """Where the store is and what this client lends it. Validated at construction."""

    master_address: str            # 'host:port' of mooncake_master's RPC server (--rpc_port)
    metadata_server: str           # 'http://host:port/metadata' (--enable_http_metadata_server)
    local_hostname: str            # this client's name and segment: 'host:port', unique per process
    protocol: str = "tcp"          # 'tcp', 'rdma' or 'ascend' (Atlas A3, the -npu wheel)
    segment_size: int = 0          # bytes of memory this client lends to the store (0: none)
    local_buffer_size: int = 16 * MiB   # the client's own staging buffer
    replica_num: int = 1           # copies per object, each in another segment (at most that many)
    holder_segment: str | None = None   # the holder's local_hostname: objects must go there
    rdma_devices: str = ""         # comma-separated device names for 'rdma' ('' : all)
    admin_url: str | None = None   # 'http://host:port' of the master's admin server (--metrics_port)
    connect_timeout_s: float = 5.0  # for the reachability checks before connecting

    def __post_init__(self) -> None:
        _host_port("master_address", self.master_address, port_required=True)
        _http_url("metadata_server", self.metadata_server)
        _host_port("local_hostname", self.local_hostname, port_required=False)
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol={self.protocol!r}: accepted {', '.join(map(repr, PROTOCOLS))}")
        _size("segment_size", self.segment_size, 0)
        _size("local_buffer_size", self.local_buffer_size, 1)
        if not (isinstance(self.replica_num, int) and not isinstance(self.replica_num, bool)
                and 1 <= self.replica_num <= 8):
            raise ValueError(f"replica_num={self.replica_num!r}: accepted an integer in 1..8")
        if self.holder_segment is not None:
            _host_port("holder_segment", self.holder_segment, port_required=True)
        if not isinstance(self.rdma_devices, str):
            raise ValueError(f"rdma_devices={self.rdma_devices!r}: accepted a string of device names")
        if self.admin_url is not None:
            _http_url("admin_url", self.admin_url)
        if not (isinstance(self.connect_timeout_s, (int, float)) and self.connect_timeout_s > 0):
            raise ValueError(f"connect_timeout_s={self.connect_timeout_s!r}: accepted a number > 0")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "MooncakeSettings":
        """From a mapping (a JSON config: ``kv_connector_extra_config``), refusing unknown keys."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(names))
        if unknown:
            raise ValueError(f"unknown Mooncake setting(s) {unknown}; accepted: {', '.join(names)}")
        return cls(**raw)


# -- tensors as spans -------------------------------------------------------------------------
def tensor_spans(tensor) -> list[Span]:
    """The one span of a contiguous tensor (host memory; device memory over ``ascend``)."""
    if not tensor.is_contiguous():
        raise ValueError(f"tensor of shape {tuple(tensor.shape)} and strides {tensor.stride()} is not "
                         "contiguous: its bytes are no span (use block_spans on the contiguous tensor)")
    return [(tensor.data_ptr(), tensor.numel() * tensor.element_size())]


def block_spans(tensor, dim: int, block_ids: Sequence[int]) -> list[Span]:
    """The spans of ``tensor.index_select(dim, block_ids)`` in the memory of ``tensor`` itself
    (contiguous), in the order of that selection's bytes: for every index of the dimensions
    before ``dim``, the blocks in ``block_ids`` order. Neighbouring spans are merged (blocks
    with consecutive ids). Writing these spans' bytes, then reading them into the spans of
    other block ids, moves the blocks; the object's bytes equal the selection's."""
    if not tensor.is_contiguous():
        raise ValueError(f"block_spans needs a contiguous tensor, got strides {tensor.stride()}")
    ndim = tensor.dim()
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim={dim}: accepted -{ndim}..{ndim - 1} for a tensor of shape "
                         f"{tuple(tensor.shape)}")
    dim %= ndim
    shape = tuple(tensor.shape)
    blocks = shape[dim]
    ids = [int(b) for b in block_ids]
    bad = [b for b in ids if not 0 <= b < blocks]
    if bad:
        raise ValueError(f"block ids {bad[:8]} out of range 0..{blocks - 1} (dim {dim} of {shape})")
    block_bytes = tensor.element_size()
    for n in shape[dim + 1:]:
        block_bytes *= n
    outer = 1
    for n in shape[:dim]:
        outer *= n
    base, row = tensor.data_ptr(), blocks * block_bytes
    spans: list[Span] = []
    for o in range(outer):
        for b in ids:
            address = base + o * row + b * block_bytes
            if spans and spans[-1][0] + spans[-1][1] == address:
                spans[-1] = (spans[-1][0], spans[-1][1] + block_bytes)
            else:
                spans.append((address, block_bytes))
    return [s for s in spans if s[1] > 0]


def nbytes(spans: Iterable[Span]) -> int:
    return sum(n for _, n in spans)


# -- the client -------------------------------------------------------------------------------
def _import_store_module():
    try:
        import mooncake.store as store_module
    except ImportError as exc:
        if "libibverbs" in str(exc) or "libnuma" in str(exc):
            raise MooncakeUnavailable(
                f"mooncake is installed but cannot load ({exc}): install the Debian packages "
                "libibverbs1 and libnuma1 (apt-get install -y libibverbs1 libnuma1)") from exc
        raise MooncakeUnavailable(
            f"mooncake.store cannot be imported ({exc}): pip install "
            + " or ".join(f"{pkg} ({where})" for where, pkg in PIP_PACKAGES.items())) from exc
    return store_module


def _bytes_address(buffer) -> tuple[int, int, Any]:
    """(address, size, keep-alive) of a bytes-like object's memory, without copying it."""
    import numpy as np
    array = np.frombuffer(buffer, dtype=np.uint8)
    return array.ctypes.data, array.size, array


def regex_literal(text: str) -> str:
    """``text`` as a literal in the regular expressions of Mooncake's ``remove_by_regex``
    (C++ ``std::regex``, ECMAScript): its syntax characters escaped, every other character as
    it is."""
    return "".join("\\" + c if c in ".^$|?*+()[]{}\\" else c for c in text)


class MooncakeStore:
    """One Mooncake Store client (one ``MooncakeDistributedStore``): connects on first use.

    Bytes: :meth:`put` / :meth:`get`. Tensors and other memory: :meth:`put_spans` /
    :meth:`get_into_spans` (with :func:`block_spans`). Objects: :meth:`exists`, :meth:`size`,
    :meth:`remove`, :meth:`remove_prefix`, :meth:`keys`, :meth:`placement`."""

    def __init__(self, settings: MooncakeSettings):
        if not isinstance(settings, MooncakeSettings):
            raise TypeError(f"settings: accepted a MooncakeSettings, got {type(settings).__name__}")
        self.settings = settings
        self._store = None
        self._registered: list[int] = []

    # -- connection ---------------------------------------------------------------------------
    def _check_reachable(self) -> None:
        s = self.settings
        host, _, port = s.master_address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=s.connect_timeout_s).close()
        except OSError as exc:
            raise MooncakeUnavailable(
                f"the Mooncake master at master_address={s.master_address!r} does not answer ({exc}): "
                "start mooncake_master (--rpc_port) there, or set master_address") from exc
        probe = s.metadata_server + ("&" if "?" in s.metadata_server else "?") + "key=ascend-rl-probe"
        try:
            urllib.request.urlopen(probe, timeout=s.connect_timeout_s).close()
        except urllib.error.HTTPError:
            pass   # it answered (a missing key is a 404): reachable
        except (urllib.error.URLError, OSError) as exc:
            raise MooncakeUnavailable(
                f"the Mooncake metadata server at metadata_server={s.metadata_server!r} does not "
                f"answer ({exc}): start mooncake_master with --enable_http_metadata_server=true "
                "--http_metadata_server_port=<port>, or set metadata_server") from exc

    def connect(self) -> "MooncakeStore":
        if self._store is not None:
            return self
        store_module = _import_store_module()
        self._check_reachable()
        s = self.settings
        store = store_module.MooncakeDistributedStore()
        rc = store.setup(s.local_hostname, s.metadata_server, s.segment_size, s.local_buffer_size,
                         s.protocol, s.rdma_devices, s.master_address)
        if rc != 0:
            raise MooncakeUnavailable(
                f"mooncake setup failed ({error_name(rc)}, {rc}) with master_address="
                f"{s.master_address!r}, metadata_server={s.metadata_server!r}, local_hostname="
                f"{s.local_hostname!r}, protocol={s.protocol!r}: is local_hostname this host's "
                "address, and unique (a second client under a name in use is refused), and "
                "protocol one this host supports?")
        self._store = store
        return self

    @property
    def client(self):
        """The connected ``MooncakeDistributedStore`` (connects)."""
        return self.connect()._store

    def close(self) -> None:
        """Leave the store: this client's segment, and the objects in it, go."""
        store, self._store = self._store, None
        if store is None:
            return
        for address in self._registered:
            store.unregister_buffer(address)
        self._registered.clear()
        store.close()

    def __enter__(self) -> "MooncakeStore":
        return self.connect()

    def __exit__(self, *exc) -> None:
        self.close()

    def register(self, spans: Iterable[Span]) -> None:
        """Register memory for direct transfers (needed over ``rdma`` / ``ascend``; ``tcp``
        reads any host memory): e.g. ``register(tensor_spans(kv_cache))`` once per cache."""
        client = self.client
        for address, size in spans:
            rc = client.register_buffer(address, size)
            if rc != 0:
                raise MooncakeError("register_buffer", None, rc, f"{size} bytes at {address:#x}")
            self._registered.append(address)

    # -- writing ------------------------------------------------------------------------------
    def _config(self):
        config = _import_store_module().ReplicateConfig()
        config.replica_num = self.settings.replica_num
        if self.settings.holder_segment is not None:
            config.preferred_segment = self.settings.holder_segment
        return config

    def _refuse_existing(self, operation: str, keys: Sequence[str]) -> None:
        found = self.client.batch_is_exist(list(keys))
        for key, rc in zip(keys, found):
            if rc == 1:
                raise KeyExistsError(operation, key)
            if rc < 0:
                raise MooncakeError(operation, key, rc, "checking whether the key exists")

    def _check_placement(self, operation: str, keys: Sequence[str]) -> None:
        holder = self.settings.holder_segment
        if holder is None:
            return
        placed = self.client.batch_get_replica_desc(list(keys))
        strays = {key: self._endpoints(placed.get(key, [])) for key in keys}
        strays = {k: e for k, e in strays.items() if holder not in e}
        if strays:
            self.client.batch_remove(list(strays), True)
            key, where = next(iter(strays.items()))
            raise MooncakeError(operation, key, NO_AVAILABLE_HANDLE,
                                f"placed on {where or 'no segment'}, not on the holder "
                                f"holder_segment={holder!r} (is the holder running, with room?); "
                                f"{len(strays)} object(s) removed")

    @staticmethod
    def _endpoints(replicas) -> list[str]:
        return [r.get_memory_descriptor().buffer_descriptor.transport_endpoint
                for r in replicas if r.is_memory_replica()]

    def put(self, key: str, data, *, replace: bool = False) -> None:
        """Store ``data`` (bytes-like, not empty) under ``key``. An existing key raises
        :class:`KeyExistsError` unless ``replace`` (then the value is replaced: upsert)."""
        address, size, keep = _bytes_address(data)
        if size == 0:
            raise ValueError(f"put {key!r}: Mooncake stores no empty objects")
        client = self.client
        if replace:
            rc = client.upsert_from(key, address, size, self._config())
        else:
            self._refuse_existing("put", [key])
            rc = client.put_from(key, address, size, self._config())
        del keep
        if rc != 0:
            raise MooncakeError("upsert" if replace else "put", key, rc, f"{size} bytes")
        self._check_placement("put", [key])

    def put_spans(self, objects: Mapping[str, Sequence[Span]], *, replace: bool = False) -> None:
        """Store each key's object as the concatenation of its spans, read in place (one
        batch). An existing key raises :class:`KeyExistsError` unless ``replace`` (then the
        old object is removed first: not atomic, a reader between the two finds none)."""
        keys = list(objects)
        if not keys:
            return
        for key in keys:
            if nbytes(objects[key]) == 0:
                raise ValueError(f"put_spans {key!r}: Mooncake stores no empty objects")
        client = self.client
        if replace:
            self.remove_many(keys)
        else:
            self._refuse_existing("put_spans", keys)
        spans = [[s for s in objects[k] if s[1] > 0] for k in keys]
        codes = client.batch_put_from_multi_buffers(
            keys, [[a for a, _ in sp] for sp in spans], [[n for _, n in sp] for sp in spans], self._config())
        failed = [(k, rc) for k, rc in zip(keys, codes) if rc != 0]
        if failed:
            done = [k for k, rc in zip(keys, codes) if rc == 0]
            if done:
                client.batch_remove(done, True)
            key, rc = failed[0]
            raise MooncakeError("put_spans", key, rc, f"{len(failed)} of {len(keys)} objects failed "
                                "(the others were removed)")
        self._check_placement("put_spans", keys)

    # -- reading ------------------------------------------------------------------------------
    def size(self, key: str) -> int | None:
        """The object's size in bytes, or None if there is none (grants a read lease)."""
        rc = self.client.get_size(key)
        if rc == OBJECT_NOT_FOUND:
            return None
        if rc < 0:
            raise MooncakeError("get_size", key, rc)
        return rc

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None if there is none; a failed read raises
        :class:`MooncakeError` (``get`` of Mooncake would answer ``b''`` for both)."""
        size = self.size(key)
        if size is None:
            return None
        out = bytearray(size)
        address, _, keep = _bytes_address(out)
        rc = self.client.get_into(key, address, size)
        del keep
        if rc == OBJECT_NOT_FOUND:
            return None
        if rc != size:
            raise MooncakeError("get", key, rc if rc < 0 else -1,
                                f"{rc} bytes read of {size}" if rc >= 0 else "")
        return bytes(out)

    def get_into_spans(self, objects: Mapping[str, Sequence[Span]]) -> dict[str, bool]:
        """Read each key's object into its spans (in order, in place; one batch). Returns per
        key whether it was there (False: no such object, its spans untouched). An object whose
        size differs from its spans', or a failed transfer, raises :class:`MooncakeError`."""
        keys = list(objects)
        if not keys:
            return {}
        spans = [[s for s in objects[k] if s[1] > 0] for k in keys]
        codes = self.client.batch_get_into_multi_buffers(
            keys, [[a for a, _ in sp] for sp in spans], [[n for _, n in sp] for sp in spans])
        found = {}
        for key, sp, rc in zip(keys, spans, codes):
            want = nbytes(sp)
            if rc == OBJECT_NOT_FOUND:
                found[key] = False
            elif rc == want:
                found[key] = True
            else:
                # Mooncake reports a size mismatch as INVALID_PARAMS (spans too small) or
                # TRANSFER_FAIL (too large): tell it apart from a dead segment
                have = self.client.get_size(key)
                detail = (f"the object holds {have} bytes, the spans {want}" if 0 <= have != want
                          else "transfer failed (the segment holding it may be gone)")
                raise MooncakeError("get_into_spans", key, rc if rc < 0 else -1, detail)
        return found

    def exists(self, key: str) -> bool:
        """Whether the object exists (grants a read lease, as Mooncake's is_exist does)."""
        rc = self.client.is_exist(key)
        if rc < 0:
            raise MooncakeError("is_exist", key, rc)
        return rc == 1

    def placement(self, key: str) -> list[str]:
        """The segments (clients' ``local_hostname``) holding the object's replicas."""
        return self._endpoints(self.client.get_replica_desc(key))

    # -- removing and listing -----------------------------------------------------------------
    def remove(self, key: str) -> bool:
        """Remove the object, leased or not; False if there was none."""
        rc = self.client.remove(key, True)
        if rc == OBJECT_NOT_FOUND:
            return False
        if rc != 0:
            raise MooncakeError("remove", key, rc)
        return True

    def remove_many(self, keys: Sequence[str]) -> int:
        """Remove these objects (forced); returns how many existed."""
        keys = list(keys)
        if not keys:
            return 0
        codes = self.client.batch_remove(keys, True)
        bad = [(k, rc) for k, rc in zip(keys, codes) if rc not in (0, OBJECT_NOT_FOUND)]
        if bad:
            raise MooncakeError("remove", bad[0][0], bad[0][1], f"{len(bad)} of {len(keys)} failed")
        return sum(rc == 0 for rc in codes)

    def remove_prefix(self, prefix: str) -> int:
        """Remove every object whose key starts with ``prefix`` (forced; no listing needed);
        returns how many."""
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix={prefix!r}: accepted a non-empty string (remove everything "
                             "with MooncakeStore.client.remove_all)")
        pattern = "^" + regex_literal(prefix)
        rc = self.client.remove_by_regex(pattern, True)
        if rc < 0:
            raise MooncakeError("remove_by_regex", prefix, rc)
        return rc

    def keys(self, prefix: str = "") -> list[str]:
        """Every key starting with ``prefix``, sorted, from the master's admin server
        (``admin_url``): Mooncake's Python client has no listing."""
        url = self.settings.admin_url
        if url is None:
            raise ValueError("MooncakeStore.keys needs admin_url: the master's admin HTTP server, "
                             "'http://<master host>:<mooncake_master --metrics_port>'")
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/get_all_keys",
                                        timeout=self.settings.connect_timeout_s) as reply:
                text = reply.read().decode()
        except (urllib.error.URLError, OSError) as exc:
            raise MooncakeUnavailable(f"the Mooncake master's admin server at admin_url={url!r} "
                                      f"does not answer ({exc})") from exc
        return sorted(k for k in text.splitlines() if k and k.startswith(prefix))


# -- processes --------------------------------------------------------------------------------
def package_binary(name: str) -> str:
    """The path of a program the mooncake wheel ships (``mooncake_master``, ``mooncake_client``),
    found without importing mooncake."""
    spec = importlib.util.find_spec("mooncake")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    raise MooncakeUnavailable(f"{name} not found (mooncake package folders: {folders or 'none'}): "
                              "pip install " + " or ".join(PIP_PACKAGES.values()))


def holder_command(settings: MooncakeSettings, *, service_port: int) -> list[str]:
    """The command of a holder: Mooncake's standalone client (``mooncake_client``), which lends
    ``settings.segment_size`` bytes under the segment ``settings.local_hostname`` (give the
    writers that name as ``holder_segment``) and does nothing else, so objects put there
    outlive the processes that put them. ``service_port``: the port its own client service
    listens on (``--port``; unused here, but bound). Run it where it outlives the replicas
    (next to the master)."""
    if settings.segment_size <= 0:
        raise ValueError("holder_command: a holder lends memory: settings.segment_size must be > 0")
    _host_port("local_hostname", settings.local_hostname, port_required=True)
    return [package_binary("mooncake_client"), f"--host={settings.local_hostname}",
            f"--port={service_port}", f"--global_segment_size={settings.segment_size}",
            f"--master_server_address={settings.master_address}",
            f"--metadata_server={settings.metadata_server}", f"--protocol={settings.protocol}",
            f"--device_names={settings.rdma_devices}", "--logtostderr"]
