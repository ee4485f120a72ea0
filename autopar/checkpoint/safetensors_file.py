"""Writing a safetensors file with the interpreter free: the header is built in Python, then
each tensor's bytes go to the file straight from its memory (a file write releases the GIL and
copies nothing in Python).  safetensors' own `save_file` serialises everything holding the
GIL, which stalls the training thread for as long while an asynchronous save writes."""
from __future__ import annotations

import json
import struct

import torch

from .metadata import tensor_bytes

# the safetensors dtype names (the format's spec)
DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def write_safetensors(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str]) -> None:
    """Write `tensors` (CPU tensors; views and tensors sharing memory alike, each one's own
    elements are written) as the safetensors file `filename`: an 8-byte little-endian header
    length, the JSON header (padded with spaces to 8 bytes), then the tensors' bytes back to
    back in the header's order."""
    header, offset = {}, 0
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor {name!r}: safetensors has no dtype {t.dtype}")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(filename, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in tensors.values():
            f.write(tensor_bytes(t))
