"""One KV block as bytes: the format every built-in connector stores, and the cache gather/scatter.

An entry is a fixed prefix, a JSON header and the payload::

    b"PBKV" | version u16 | header length u32 | header (JSON, UTF-8) | payload

The header names the model identity, the block layout, the block hash, the
payload length and an HMAC-SHA256 of header and payload under the store's
secret key (:func:`patchbay.interfaces.sign_entry`), so a reader rejects an entry that is truncated, corrupted, forged
by someone without the key, of another model or of another layout *before* a
byte of it reaches the KV cache.  Entries are untrusted input: the header must
be a small flat JSON object, and a payload of floats must be finite.  The payload is every layer's keys then values
for the block, layer by layer in registration order:
``[num_layers, 2, block_size, num_kv_heads, head_size]`` in the cache dtype.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from patchbay.interfaces.kv_connector import sign_entry, verify_entry

if TYPE_CHECKING:
    import torch

MAGIC = b"PBKV"
VERSION = 2
"""2: an HMAC instead of version 1's CRC-32 (version 1 entries are refused, and recomputed)."""
_PREFIX = struct.Struct("<4sHI")  # magic, version, header length
MAX_HEADER_BYTES = 4096
"""A real header is ~300 bytes; anything far larger is refused before it is parsed."""
_HEADER_KEYS = {"model_id", "layout", "block_hash", "payload_bytes", "mac"}

_DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}


class BlockDecodeError(ValueError):
    """A stored entry that must not be loaded; the message says what was expected and what was found."""


@dataclass(frozen=True)
class BlockLayout:
    """The shape of one block across the model: entries of another layout are never loaded."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str

    @property
    def payload_bytes(self) -> int:
        """Bytes of one block: 2 (K, V) x layers x tokens x heads x head size x dtype size."""
        element = _DTYPE_SIZES.get(self.dtype)
        if element is None:
            raise ValueError(f"unsupported KV-cache dtype {self.dtype!r} (supported: {', '.join(_DTYPE_SIZES)})")
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * element


def key_id(key: bytes) -> str:
    """A public name of a store's secret ``key``: an HMAC of a constant, which tells keys apart and reveals none."""
    return hmac.new(key, b"patchbay kv store namespace", hashlib.sha256).hexdigest()[:16]


def store_namespace(model_id: str, block_size: int, dtype: str, key: bytes) -> str:
    """A short, filesystem- and key-safe name for (model identity, block size, dtype, the store's key).

    The scheduler side knows only these; a layout mismatch beyond them
    (heads, head size, layers) is caught by the header when loading.  The
    key's id keeps the entries of runners with different keys apart: a
    runner never reads, let alone discards, an entry it cannot authenticate
    because another key signed it.
    """
    text = json.dumps([model_id, block_size, dtype, key_id(key)])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def max_entry_bytes(layout: BlockLayout) -> int:
    """The largest entry a store may hold for ``layout``: larger ones are refused before they are read."""
    return _PREFIX.size + MAX_HEADER_BYTES + layout.payload_bytes


def encode_block(
    model_id: str, layout: BlockLayout, block_hash: bytes, payload: bytes | memoryview, *, key: bytes
) -> bytes:
    """The stored form of one block (prefix, header, payload), authenticated with ``key``."""
    payload = memoryview(payload).cast("B")
    fields = {
        "model_id": model_id,
        "layout": asdict(layout),
        "block_hash": bytes(block_hash).hex(),
        "payload_bytes": payload.nbytes,
    }
    header = json.dumps({**fields, "mac": sign_entry(key, fields, payload)}, sort_keys=True).encode()
    return b"".join((_PREFIX.pack(MAGIC, VERSION, len(header)), header, payload))


def read_header(data: bytes | memoryview) -> tuple[dict, memoryview]:
    """Split an entry into its header (a flat JSON object of the expected keys) and payload, checking the framing."""
    data = memoryview(data).cast("B")
    if data.nbytes < _PREFIX.size:
        raise BlockDecodeError(f"truncated entry: {data.nbytes} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, version, header_length = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise BlockDecodeError(f"not a KV block entry: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise BlockDecodeError(f"entry format version {version}, expected {VERSION}")
    if header_length > MAX_HEADER_BYTES:
        raise BlockDecodeError(f"entry header of {header_length} bytes, more than the {MAX_HEADER_BYTES} allowed")
    end = _PREFIX.size + header_length
    if data.nbytes < end:
        raise BlockDecodeError(f"truncated entry: header needs {end} bytes, found {data.nbytes}")
    try:
        header = json.loads(bytes(data[_PREFIX.size : end]))
    except (ValueError, RecursionError) as exc:
        raise BlockDecodeError(f"unreadable entry header: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise BlockDecodeError(f"entry header is a JSON {type(header).__name__}, expected an object")
    if set(header) != _HEADER_KEYS or not isinstance(header.get("layout"), dict):
        raise BlockDecodeError(f"entry header has keys {sorted(header)[:8]}, expected {sorted(_HEADER_KEYS)}")
    return header, data[end:]


def decode_block(
    data: bytes | memoryview, *, model_id: str, layout: BlockLayout, block_hash: bytes, key: bytes
) -> memoryview:
    """The payload of a stored entry, after checking identity, layout, hash, length, authentication and finiteness."""
    if len(data) > max_entry_bytes(layout):
        raise BlockDecodeError(f"entry of {len(data)} bytes, more than the {max_entry_bytes(layout)} a block takes")
    header, payload = read_header(data)
    if header.get("model_id") != model_id:
        raise BlockDecodeError(f"entry of model {header.get('model_id')!r}, expected {model_id!r}")
    if header.get("layout") != asdict(layout):
        raise BlockDecodeError(f"entry of block layout {header.get('layout')}, expected {asdict(layout)}")
    if header.get("block_hash") != bytes(block_hash).hex():
        raise BlockDecodeError(f"entry of block {header.get('block_hash')}, expected {bytes(block_hash).hex()}")
    expected = layout.payload_bytes
    if header.get("payload_bytes") != expected or payload.nbytes != expected:
        raise BlockDecodeError(
            f"truncated or padded entry: payload of {payload.nbytes} bytes "
            f"(header says {header.get('payload_bytes')}), expected {expected}"
        )
    fields = {name: value for name, value in header.items() if name != "mac"}
    if not verify_entry(key, fields, payload, header["mac"]):
        raise BlockDecodeError(
            "corrupted or forged entry: authentication code mismatch (written without this store's key, or damaged)"
        )
    if not payload_is_finite(payload, layout.dtype):
        raise BlockDecodeError("entry payload holds NaN or infinite values")
    return payload


def payload_is_finite(payload: memoryview, dtype: str) -> bool:
    """Whether every value of a block payload of ``dtype`` is finite."""
    import torch

    values = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(getattr(torch, dtype))
    if dtype.startswith("float8"):
        values = values.float()
    return bool(torch.isfinite(values).all())


def damage_entry(data: bytes, how: str, key: bytes) -> bytes | None:
    """``data`` damaged for fault tests: ``missing`` (``None``), ``truncated``, ``corrupted``,
    ``other_model`` or ``other_layout`` (a valid entry of another identity / shape, same bytes, signed with
    ``key``), ``forged`` (the same entry signed with another key), ``not_an_object`` (a header that is JSON but
    no object), ``deeply_nested`` (a header nested past the parser's recursion limit) or ``non_finite``
    (a validly signed entry whose payload holds a NaN)."""
    if how == "missing":
        return None
    if how == "truncated":
        return data[: len(data) // 2]
    if how == "corrupted":  # flip the last payload byte
        return data[:-1] + bytes([data[-1] ^ 0xFF])
    if how in ("not_an_object", "deeply_nested"):
        # Deeper than Python's recursion limit, within the header size limit.
        bad_header = b"[1, 2, 3]" if how == "not_an_object" else b"[" * 2000 + b"]" * 2000
        return _PREFIX.pack(MAGIC, VERSION, len(bad_header)) + bad_header + data[-64:]
    header, payload = read_header(data)
    layout = BlockLayout(**header["layout"])
    block_hash = bytes.fromhex(header["block_hash"])
    if how == "other_model":
        return encode_block(f"not-{header['model_id']}", layout, block_hash, payload, key=key)
    if how == "other_layout":  # same number of bytes, other shape
        other = BlockLayout(
            layout.num_layers, layout.block_size, layout.num_kv_heads * 2, layout.head_size // 2, layout.dtype
        )
        return encode_block(header["model_id"], other, block_hash, payload, key=key)
    if how == "forged":
        return encode_block(header["model_id"], layout, block_hash, payload, key=b"not-" + key)
    if how == "non_finite":
        import torch

        values = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(getattr(torch, layout.dtype)).clone()
        values[0] = math.nan
        return encode_block(header["model_id"], layout, block_hash, values.view(torch.uint8).numpy().tobytes(), key=key)
    raise ValueError(
        f"unknown damage {how!r} (expected missing, truncated, corrupted, other_model, other_layout, "
        f"forged, not_an_object, deeply_nested, non_finite)"
    )


# -- the paged cache side ------------------------------------------------------------------------


class PagedCaches:
    """Every layer's key and value caches, read and written a block at a time.

    ``split(kv_cache) -> (key_cache, value_cache)`` each
    ``[num_blocks, block_size, num_kv_heads, head_size]`` (the attention
    backend's ``split_kv_cache``).
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], split: Callable) -> None:
        if not kv_caches:
            raise ValueError("register_kv_caches got no layers")
        self.layers = [split(kv_cache) for kv_cache in kv_caches.values()]
        key_cache = self.layers[0][0]
        _, block_size, num_kv_heads, head_size = key_cache.shape
        self.device = key_cache.device
        self.dtype = key_cache.dtype
        self.layout = BlockLayout(
            len(self.layers), block_size, num_kv_heads, head_size, str(key_cache.dtype).removeprefix("torch.")
        )
        for key_cache, value_cache in self.layers:
            if key_cache.shape[1:] != self.layers[0][0].shape[1:] or value_cache.shape != key_cache.shape:
                raise ValueError(
                    f"every layer must have one block layout; found {tuple(key_cache.shape)} "
                    f"and {tuple(value_cache.shape)} next to {tuple(self.layers[0][0].shape)}"
                )

    def gather(self, block_ids: Sequence[int]) -> list[memoryview]:
        """The payload of each block, on the host: one device-to-host copy for all of them."""
        import torch

        if not block_ids:
            return []
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        # [layers, 2, blocks, tokens, heads, head_size] -> [blocks, layers, 2, tokens, heads, head_size]
        stacked = torch.stack([torch.stack((keys[index], values[index])) for keys, values in self.layers])
        host = stacked.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
        as_bytes = host.view(torch.uint8).reshape(len(block_ids), -1).numpy()
        return [memoryview(row) for row in as_bytes]

    def scatter(self, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]) -> None:
        """Write each payload into its block of every layer (one host-to-device copy)."""
        import torch

        if not block_ids:
            return
        layout = self.layout
        shape = (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_size)
        host = torch.stack([torch.frombuffer(bytearray(payload), dtype=torch.uint8) for payload in payloads])
        blocks = host.view(self.dtype).reshape(len(block_ids), *shape).to(self.device)
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        for layer, (keys, values) in enumerate(self.layers):
            keys[index] = blocks[:, layer, 0]
            values[index] = blocks[:, layer, 1]
