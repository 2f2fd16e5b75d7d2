"""The wire format of weights streamed to vLLM hosts: one payload of HF-named tensors in the
serving dtype, each whole or as the elements that changed since a base version, each with the
checksum of its whole tensor; and the two ways a payload travels (a shared-memory file on the
same node, a TCP socket from another).

Both sides import this module: the trainer (rl/rollout/weight_stream.py) and the vLLM worker
(rl/rollout/vllm_weight_engine.py), so it needs only numpy, ml_dtypes and xxhash.

A payload is one byte string; its table (a list of entries, sent as JSON in the update request)
says where each tensor's bytes lie:
  full     the tensor's bytes, C order;
  indices  `count` int32 flat indices, then `count` values in the tensor's dtype; the other
           elements keep the base version's bits.
`checksum` is xxh3-64 of the WHOLE tensor's bytes after decoding, so a delta is verified bit for
bit against the full tensor the trainer holds.
"""

from __future__ import annotations

import atexit
import mmap
import os
import socket
import threading
import time
import uuid

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np
import xxhash

ENCODINGS = ("full", "indices")
TOKEN_BYTES = 16
_CHUNK = 1 << 22  # socket reads and writes move at most this many bytes at a time


class WireError(RuntimeError):
    """A payload that does not decode, or decodes to a tensor whose checksum is not the one sent."""


def checksum(array: np.ndarray) -> str:
    """xxh3-64 (hex) of an array's bytes in C order."""
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)  # bfloat16 has no buffer code
    return xxhash.xxh3_64_hexdigest(memoryview(raw))


def bits(array: np.ndarray) -> np.ndarray:
    """The array viewed as unsigned integers of its item size (bit-exact comparison)."""
    return array.view(f"u{array.dtype.itemsize}")


def encode(new: np.ndarray, base: np.ndarray | None) -> tuple[str, list[np.ndarray], int]:
    """(encoding, byte arrays to send, changed element count): the changed elements of `new`
    against `base` (same shape and dtype) when that is smaller than `new`, else `new` whole."""
    if base is None or base.shape != new.shape or base.dtype != new.dtype or new.size >= 2**31:
        return "full", [np.ascontiguousarray(new)], new.size
    changed = np.flatnonzero(bits(new).reshape(-1) != bits(base).reshape(-1)).astype(np.int32)
    if changed.size * (4 + new.dtype.itemsize) >= new.nbytes:
        return "full", [np.ascontiguousarray(new)], changed.size
    return "indices", [changed, np.ascontiguousarray(new).reshape(-1)[changed]], changed.size


def entry_size(entry: dict) -> int:
    """Bytes an entry takes in its payload."""
    dtype = np.dtype(entry["dtype"])
    if entry["encoding"] == "full":
        return int(np.prod(entry["shape"], dtype=np.int64)) * dtype.itemsize
    return entry["count"] * (4 + dtype.itemsize)


def decode(entry: dict, payload: memoryview, base: np.ndarray | None) -> np.ndarray:
    """The whole tensor an entry describes, its checksum verified.

    full: a view of the payload; indices: `base` (the host's copy of the base version) patched
    in place. Raises WireError on a bad entry or a checksum mismatch."""
    name, encoding = entry["name"], entry["encoding"]
    dtype, shape = np.dtype(entry["dtype"]), tuple(entry["shape"])
    start = entry["offset"]
    end = start + entry_size(entry)
    if encoding not in ENCODINGS:
        raise WireError(f"{name}: encoding {encoding!r}; valid: {ENCODINGS}")
    if end > len(payload):
        raise WireError(f"{name}: bytes {start}:{end} lie past the payload's {len(payload)}")
    if encoding == "full":
        tensor = np.frombuffer(payload[start:end], dtype=dtype).reshape(shape)
    else:
        if base is None or base.shape != shape or base.dtype != dtype:
            have = None if base is None else (base.shape, str(base.dtype))
            raise WireError(f"{name}: a delta needs a base of {shape} {dtype}; the host has {have}")
        count = entry["count"]
        indices = np.frombuffer(payload[start : start + 4 * count], dtype=np.int32)
        values = np.frombuffer(payload[start + 4 * count : end], dtype=dtype)
        if count and (indices.min() < 0 or indices.max() >= base.size):
            raise WireError(f"{name}: delta indices outside 0..{base.size - 1}")
        base.reshape(-1)[indices] = values
        tensor = base
    got = checksum(tensor)
    if got != entry["checksum"]:
        raise WireError(
            f"{name}: checksum {got} of the {encoding} tensor does not match the trainer's "
            f"{entry['checksum']}"
        )
    return tensor


# ---------------------------------------------------------------------------------------------
# Transport: shared memory on the same node.


class ShmPayload:
    """A payload in a file under /dev/shm (a tmpfs: memory, no disk), reused across versions."""

    def __init__(self, directory: str = "/dev/shm"):
        self.path = os.path.join(directory, f"tandem-weights-{os.getpid()}-{uuid.uuid4().hex}")
        self.size = 0
        self._mmap: mmap.mmap | None = None
        atexit.register(self.unlink)  # a tmpfs file holds memory until removed

    def buffer(self, nbytes: int) -> memoryview:
        """A writable view of the first nbytes (the file grows as needed)."""
        if nbytes > self.size:
            self.close()
            with open(self.path, "a+b") as f:
                f.truncate(nbytes)
                self._mmap = mmap.mmap(f.fileno(), nbytes)
            self.size = nbytes
        assert self._mmap is not None
        return memoryview(self._mmap)[:nbytes]

    def close(self) -> None:
        """Unmaps the file (it stays until unlink)."""
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a view still alive: the mapping goes when it does
                pass
            self._mmap = None

    def unlink(self) -> None:
        """Unmaps and removes the file."""
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def read_shm(path: str, nbytes: int) -> memoryview:
    """The first nbytes of a payload file, mapped copy-on-write (writes stay private)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < nbytes:
            raise WireError(f"payload file {path} has {size} bytes, {nbytes} expected")
        return memoryview(mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_COPY))


# ---------------------------------------------------------------------------------------------
# Transport: a TCP socket, for hosts on other nodes.


class PayloadServer:
    """Serves payloads over TCP: a client sends a token, gets 8 bytes of length, then the bytes.

    One payload per token; a token is served any number of times until withdrawn."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 120.0):
        self.timeout_s = timeout_s
        self._payloads: dict[bytes, memoryview] = {}
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, port))
        bound_host, bound_port = self._sock.getsockname()[:2]
        self.address = f"{bound_host}:{bound_port}"
        self._closed = False
        threading.Thread(target=self._accept, name="payload-server", daemon=True).start()

    def offer(self, payload: memoryview) -> str:
        """Makes payload available; returns its token (hex)."""
        token = os.urandom(TOKEN_BYTES)
        with self._lock:
            self._payloads[token] = payload
        return token.hex()

    def withdraw(self, token: str) -> None:
        """Stops serving a token's payload."""
        with self._lock:
            self._payloads.pop(bytes.fromhex(token), None)

    def close(self) -> None:
        """Stops accepting connections."""
        self._closed = True
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self.timeout_s)
            try:
                token = _recv_exactly(conn, TOKEN_BYTES, time.monotonic() + self.timeout_s)
                with self._lock:
                    payload = self._payloads.get(bytes(token))
                if payload is None:
                    conn.sendall((2**64 - 1).to_bytes(8, "little"))  # unknown token
                    return
                conn.sendall(len(payload).to_bytes(8, "little"))
                for i in range(0, len(payload), _CHUNK):
                    conn.sendall(payload[i : i + _CHUNK])
            except OSError:
                return  # the client went away; it reports the failure


def read_socket(address: str, token: str, nbytes: int, timeout_s: float) -> memoryview:
    """Fetches a payload of nbytes from a PayloadServer at host:port within timeout_s."""
    end = time.monotonic() + timeout_s
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
        conn.sendall(bytes.fromhex(token))
        size = int.from_bytes(_recv_exactly(conn, 8, end), "little")
        if size == 2**64 - 1:
            raise WireError(f"payload server {address} does not know token {token[:8]}...")
        if size != nbytes:
            raise WireError(f"payload server {address} sent {size} bytes, {nbytes} expected")
        return _recv_exactly(conn, nbytes, end)


def _recv_exactly(conn: socket.socket, nbytes: int, end: float) -> memoryview:
    out = memoryview(bytearray(nbytes))
    got = 0
    while got < nbytes:
        left = end - time.monotonic()
        if left <= 0:
            raise WireError(f"received {got} of {nbytes} bytes before the deadline")
        conn.settimeout(left)
        n = conn.recv_into(out[got:], min(_CHUNK, nbytes - got))
        if n == 0:
            raise WireError(f"connection closed after {got} of {nbytes} bytes")
        got += n
    return out
