"""The disk tier: a content-addressed store of KV blocks, one file per block, that outlives the process.

A block's file is named by its chained prefix hash (`tether.block_hash`) inside a folder named by the
model's fingerprint (`model_fingerprint`: config, KV dtype, block size and a digest of the weights), so a
different model, dtype, rope setting or weights never finds another's blocks. Each file holds a header
(the block's token ids, the KV's dtype and shape, a CRC-32 of the payload) and the payload (per layer, K
then V). A read checks all of it: a corrupt, truncated or foreign file is a miss (and is deleted), never
wrong KV. Writes go to a temporary file renamed into place, so a reader sees a whole file or none; there
is no fsync: a file torn by a power loss fails its checksum and reads as a miss. The folder is bounded by
`capacity_bytes`, least recently used files deleted first (the order survives restarts through the files'
modification times). A write that fails (disk full, read-only) is logged and skipped. Not safe for two
engines writing the same folder at once (each keeps its own index and budget; a file the other deleted
is a miss).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import struct
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from tether.block_hash import BlockHash
from tether.errors import ConfigError

logger = logging.getLogger(__name__)
MAGIC = b"TETHERKV1\n"
SUFFIX = ".kv"
_HEADER_LENGTH = struct.Struct("<I")


def model_fingerprint(
    model_config: object,
    kv_dtype: torch.dtype,
    block_size: int,
    parameters: Iterable[tuple[str, torch.Tensor]],
) -> str:
    """A name for everything the KV of a token prefix depends on: the model config (architecture,
    shapes, rope settings), the KV dtype, the block size and the bytes of every weight."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(model_config).encode())
    digest.update(f"|{kv_dtype}|{block_size}|".encode())
    for name, tensor in parameters:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class DiskBlockStore:
    def __init__(
        self,
        root: Path,
        fingerprint: str,
        capacity_bytes: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> None:
        """`block_shape`: one block's payload, [2 * layers, block_size, kv_heads, head_dim]."""
        self.directory = root / fingerprint
        self.block_shape = block_shape
        self.dtype = dtype
        self.capacity_bytes = capacity_bytes
        self.payload_bytes = torch.Size(block_shape).numel() * torch.empty((), dtype=dtype).element_size()
        if self.payload_bytes + 4096 > capacity_bytes:
            raise ConfigError(
                f"engine: kv_disk_tier_mib = {capacity_bytes / 2**20:g} holds no KV block "
                f"({self.payload_bytes / 2**20:.2f} MiB each): expected more"
            )
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(
                f"engine: kv_disk_tier_dir = {str(root)!r}: cannot create it: {error}"
            ) from None
        self._files: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> file size, least recent first
        self.used_bytes = 0
        self._scan()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._files

    def __len__(self) -> int:
        return len(self._files)

    def write(self, block_hash: BlockHash, token_ids: tuple[int, ...], payload: torch.Tensor) -> int:
        """Store a block (payload of `block_shape` on the CPU); returns the bytes written, 0 if it was
        already there."""
        if block_hash in self._files:
            self._files.move_to_end(block_hash)
            return 0
        assert tuple(payload.shape) == self.block_shape and payload.dtype == self.dtype
        data: Any = payload.contiguous().reshape(-1).view(torch.uint8).numpy()
        header = json.dumps(
            {
                "token_ids": list(token_ids),
                "dtype": str(self.dtype),
                "shape": list(self.block_shape),
                "crc32": zlib.crc32(data),
            }
        ).encode()
        size = len(MAGIC) + _HEADER_LENGTH.size + len(header) + self.payload_bytes
        self._make_room(size)
        path = self._path(block_hash)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with temporary.open("wb") as file:
                file.write(MAGIC + _HEADER_LENGTH.pack(len(header)) + header)
                file.write(data)
            os.replace(temporary, path)
        except OSError as error:  # a full or read-only disk costs the tier this block, not the engine
            temporary.unlink(missing_ok=True)
            logger.warning("KV disk tier: cannot write %s: %s", path, error)
            return 0
        self._files[block_hash] = size
        self.used_bytes += size
        return size

    def read_into(self, block_hash: BlockHash, token_ids: tuple[int, ...], out: torch.Tensor) -> bool:
        """Read the block's payload into `out` (contiguous, `block_shape`, on the CPU) if its file is
        there, whole and holds these tokens; else False (and a bad file is deleted)."""
        if block_hash not in self._files:
            return False
        assert tuple(out.shape) == self.block_shape and out.dtype == self.dtype and out.is_contiguous()
        path = self._path(block_hash)
        buffer = out.reshape(-1).view(torch.uint8).numpy()
        try:
            with path.open("rb") as file:
                whole = self._read_checked(file, token_ids, buffer)
        except (OSError, ValueError):
            whole = False
        if not whole:
            self._forget(block_hash)
            return False
        self._files.move_to_end(block_hash)
        with contextlib.suppress(OSError):
            os.utime(path)  # the LRU order a restarted engine reads back
        return True

    def _read_checked(self, file: io.BufferedReader, token_ids: tuple[int, ...], buffer: Any) -> bool:
        """Header, payload (read straight into `buffer`) and checksum of an open block file all match."""
        start = file.read(len(MAGIC) + _HEADER_LENGTH.size)
        if len(start) != len(MAGIC) + _HEADER_LENGTH.size or not start.startswith(MAGIC):
            return False
        (header_length,) = _HEADER_LENGTH.unpack_from(start, len(MAGIC))
        header = json.loads(file.read(header_length))  # a ValueError if torn
        if (
            not isinstance(header, dict)
            or header.get("token_ids") != list(token_ids)
            or header.get("dtype") != str(self.dtype)
            or header.get("shape") != list(self.block_shape)
        ):
            return False
        if file.readinto(buffer) != self.payload_bytes or file.read(1):
            return False
        return bool(header.get("crc32") == zlib.crc32(buffer))

    def _path(self, block_hash: BlockHash) -> Path:
        return self.directory / f"{block_hash.hex()}{SUFFIX}"

    def _make_room(self, num_bytes: int) -> None:
        while self._files and self.used_bytes + num_bytes > self.capacity_bytes:
            self._forget(next(iter(self._files)))

    def _forget(self, block_hash: BlockHash) -> None:
        self.used_bytes -= self._files.pop(block_hash)
        self._path(block_hash).unlink(missing_ok=True)

    def _scan(self) -> None:
        """Index the files a previous engine left, least recently used first; drop temporaries."""
        found: list[tuple[float, BlockHash, int]] = []
        for path in self.directory.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
                continue
            try:
                block_hash = bytes.fromhex(path.name.removesuffix(SUFFIX))
                status = path.stat()
            except (ValueError, OSError):
                continue
            if path.suffix == SUFFIX:
                found.append((status.st_mtime, block_hash, status.st_size))
        for _, block_hash, size in sorted(found):
            self._files[block_hash] = size
            self.used_bytes += size
        self._make_room(0)
