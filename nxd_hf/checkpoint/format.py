"""The on-disk format: safetensors files of logical slices, and reading a local shard back.

A tensor is stored as parts; a part is one safetensors entry holding rows ``[start, stop)``
of the logical tensor along ``dim`` (``dim`` None: the whole tensor). The index maps
``section -> name -> {shape, dtype, parts: [{file, key, dim, start, stop, crc32}]}``; files
carry their size and the CRC-32 of their header and of each entry (checked before any tensor is
read). Reading a local shard reads only the rows it
holds, in contiguous runs; padding rows become zeros.
"""

import itertools
import json
import os
import zlib

import torch
from safetensors import safe_open

from nxd_hf.checkpoint.hf_safetensors import row_runs
from nxd_hf.checkpoint.logical import LogicalTensor
from nxd_hf.checkpoint.store import durable_open
from nxd_hf.parallel_layers.sharding import shard_from_full


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parts_of(lt: LogicalTensor, value: torch.Tensor, name: str, file: str) -> list[tuple[str, torch.Tensor, dict]]:
    """(entry key, tensor, part record) for what this rank writes of ``value`` (laid out as
    ``lt.tensor``, or a scalar such as Adam's step)."""
    value = value.detach()
    if lt.dim is None or value.shape != lt.tensor.shape:
        if not lt.writes_whole:
            return []
        disk = lt.to_disk(value) if value.shape == lt.tensor.shape else value
        return [(name, disk.contiguous(), {"file": file, "key": name, "dim": None, "start": 0, "stop": 0})]
    disk = lt.to_disk(value)
    out = []
    for local_start, local_stop, start in lt.runs:
        stop = start + local_stop - local_start
        key = f"{name}@{start}"
        piece = disk.narrow(lt.dim, local_start, local_stop - local_start)
        record = {"file": file, "key": key, "dim": lt.dim, "start": start, "stop": stop}
        if lt.inner_dim is None:
            out.append((key, piece.contiguous(), record))
            continue
        for inner_local, inner_local_stop, inner_start in lt.inner_runs:  # a box: these rows x these inner rows
            size = inner_local_stop - inner_local
            box = {**record, "key": f"{key}.{inner_start}", "inner": [lt.inner_dim, inner_start, inner_start + size]}
            out.append((box["key"], piece.narrow(lt.inner_dim, inner_local, size).contiguous(), box))
    return out


def _ranges(part: dict, shape: list[int]) -> list[tuple[int, int]]:
    """(start, stop) along every dim of the logical tensor that ``part`` holds."""
    ranges = [(0, size) for size in shape]
    for dim, start, stop in ([part["dim"], part["start"], part["stop"]], part.get("inner") or [None, 0, 0]):
        if dim is not None:
            ranges[dim] = (start, stop)
    return ranges


def _local_runs(rows: torch.Tensor, start: int, stop: int) -> list[tuple[int, int, int]]:
    """(local start, local stop, logical start) of the local ``rows`` (-1: padding) in ``[start, stop)``."""
    runs, local = [], 0
    for first, last, is_padding in row_runs(rows):  # logical [first, last), or last - first padding rows
        lo, hi = max(first, start), min(last, stop)
        if not is_padding and lo < hi:
            runs.append((local + lo - first, local + hi - first, lo))
        local += last - first
    return runs


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def write_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> dict:
    """Write ``tensors`` as one safetensors file straight from their memory (no serialized copy
    of the whole file), fsync'd; returns its size and the CRC-32 of its header and of each
    tensor's bytes. ``metadata``: more safetensors metadata (strings)."""
    header, offset, views = {"__metadata__": {"format": "pt", **(metadata or {})}}, 0, []
    for key, tensor in tensors.items():
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        header[key] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
        views.append((key, data))
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    head = len(encoded).to_bytes(8, "little") + encoded
    os.makedirs(os.path.dirname(path), exist_ok=True)
    crcs = {}
    with durable_open(path, "wb") as f:
        f.write(head)
        for key, data in views:
            f.write(memoryview(data))
            crcs[key] = zlib.crc32(data)
    return {"size": len(head) + offset, "header_crc32": zlib.crc32(head), "crc32": crcs}


def file_checksum(path: str) -> dict:
    """Size and CRC-32 of a whole (non-tensor) file."""
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            value = zlib.crc32(chunk, value)
    return {"size": os.path.getsize(path), "file_crc32": value}


def file_problem(path: str, expected: dict) -> str | None:
    """What is wrong with a checkpoint file (its size, header and every tensor's checksum, or
    the whole file's checksum), or None."""
    if not os.path.exists(path):
        return "is missing"
    size = os.path.getsize(path)
    if size != expected["size"]:
        return f"has {size} bytes, the index says {expected['size']} (truncated or overwritten)"
    if "file_crc32" in expected:
        return None if file_checksum(path)["file_crc32"] == expected["file_crc32"] else (
            "does not match its checksum (corrupted or edited)")
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        encoded = f.read(length) if 0 < length <= size - 8 else b""
        if zlib.crc32(length.to_bytes(8, "little") + encoded) != expected["header_crc32"]:
            return "has a header that does not match its checksum (corrupted)"
        header = json.loads(encoded)
        for key, crc in expected["crc32"].items():
            start, stop = header[key]["data_offsets"]
            f.seek(8 + length + start)
            value, remaining = 0, stop - start
            while remaining > 0:
                chunk = f.read(min(1 << 24, remaining))
                if not chunk:
                    break
                value, remaining = zlib.crc32(chunk, value), remaining - len(chunk)
            if value != crc:
                return f"tensor {key} does not match its checksum (corrupted)"
    return None


class Reader:
    """Reads logical tensors of one checkpoint directory (files opened once, memory-mapped)."""

    def __init__(self, directory: str, index: dict):
        self.directory, self.index = directory, index
        self._handles, self._headers = {}, {}

    def close(self) -> None:
        """Unmap the files: pages read so far stop counting in this process's memory."""
        self._handles.clear()

    def _handle(self, part: dict):
        if part["file"] not in self._handles:
            self._handles[part["file"]] = safe_open(os.path.join(self.directory, part["file"]), framework="pt")
        return self._handles[part["file"]]

    def _get(self, part: dict):
        return self._handle(part).get_slice(part["key"])

    def full(self, section: str, name: str) -> torch.Tensor:
        """The whole logical tensor, read with plain file reads into one new tensor (parts along
        dim 0 straight into place): no file stays mapped, so memory is the tensor itself."""
        entry = self.index["tensors"][section][name]
        out = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))
        for part in entry["parts"]:
            if part["dim"] is None:
                self._read_into(part, out)
            elif "inner" in part:
                piece = out[tuple(slice(a, b) for a, b in _ranges(part, entry["shape"]))]
                piece.copy_(self._read_into(part, torch.empty(piece.shape, dtype=out.dtype)))
            elif part["dim"] == 0:
                self._read_into(part, out[part["start"] : part["stop"]])
            else:
                piece = out.narrow(part["dim"], part["start"], part["stop"] - part["start"])
                piece.copy_(self._read_into(part, torch.empty(piece.shape, dtype=out.dtype)))
        return out

    def _read_into(self, part: dict, out: torch.Tensor) -> torch.Tensor:
        path = os.path.join(self.directory, part["file"])
        if path not in self._headers:
            with open(path, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                self._headers[path] = (8 + length, json.loads(f.read(length)))
        data_start, header = self._headers[path]
        start, stop = header[part["key"]]["data_offsets"]
        target = out.view(-1).view(torch.uint8).numpy()
        assert target.nbytes == stop - start, f"{part['key']}: {target.nbytes} bytes expected, {stop - start} stored"
        with open(path, "rb") as f:
            f.seek(data_start + start)
            f.readinto(memoryview(target))
        return out

    def local(self, section: str, name: str, lt: LogicalTensor, like: torch.Tensor) -> torch.Tensor:
        """The rows of ``name`` this rank holds, laid out as ``like`` (``lt.tensor`` or a scalar)."""
        parts = self.index["tensors"][section][name]["parts"]
        if lt.dim is None or like.shape != lt.tensor.shape:
            full = self.full(section, name)
            return lt.from_disk(full) if like.shape == lt.tensor.shape else full
        if lt.inner_dim is not None or any("inner" in p for p in parts):  # sharded along two dims
            return lt.from_disk(self._box(parts, lt, like.dtype))
        if not all(p["dim"] == lt.dim for p in parts):  # saved unsharded or along another dim
            return lt.from_disk(shard_from_full(self.full(section, name), lt.dim, lt.rows))
        return lt.from_disk(self._rows(parts, lt, like.dtype))

    def _rows(self, parts: list[dict], lt: LogicalTensor, dtype: torch.dtype) -> torch.Tensor:
        shape = list(lt.shape)
        parts = sorted(parts, key=lambda p: p["start"])
        pieces = []
        for start, stop, is_padding in row_runs(lt.rows):
            if is_padding:
                shape[lt.dim] = stop - start
                pieces.append(torch.zeros(shape, dtype=dtype))
                continue
            for part in parts:
                a, b = max(start, part["start"]), min(stop, part["stop"])
                if a < b:
                    index = [slice(None)] * len(shape)
                    index[lt.dim] = slice(a - part["start"], b - part["start"])
                    pieces.append(self._get(part)[tuple(index)].to(dtype))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=lt.dim)

    def _box(self, parts: list[dict], lt: LogicalTensor, dtype: torch.dtype) -> torch.Tensor:
        """The local rows along ``lt.dim`` (and ``lt.inner_dim``) from parts of any layout (whole, along
        one dim, boxes along two): only the rows held here are read; padding rows stay zeros."""
        needed = {lt.dim: lt.rows} if lt.inner_dim is None else {lt.dim: lt.rows, lt.inner_dim: lt.inner_rows}
        shape = [len(needed[d]) if d in needed else size for d, size in enumerate(lt.shape)]
        out = torch.zeros(shape, dtype=dtype)
        for part in parts:
            ranges = _ranges(part, list(lt.shape))
            per_dim = [_local_runs(needed[d], a, b) if d in needed else [(a, b, a)] for d, (a, b) in enumerate(ranges)]
            if not all(per_dim):
                continue
            stored = self._get(part)
            for box in itertools.product(*per_dim):
                source = tuple(slice(s - a, s - a + stop - start) for (start, stop, s), (a, _) in zip(box, ranges))
                out[tuple(slice(start, stop) for start, stop, _ in box)] = stored[source].to(dtype)
        return out
