"""The saved-trace file: a zip archive anyone can open with `unzip` and read without torchlens.

    trace.json          the recording's settings, header and footer, scopes, findings, the
                        attempted op of a failure, the forward's output (as data; tensors by name)
    events.jsonl        one JSON object per forward event, in order
    backward-K.jsonl    one per event of the K-th backward through the forward's graph
    tensors.safetensors kept values and output tensors (safetensors: a JSON header, raw bytes)

Reading never unpickles, imports or calls anything named in the file; sizes are checked before
anything is decompressed, so a crafted archive is refused instead of filling memory.
"""

from __future__ import annotations

import json
import os
import zipfile
from typing import Dict, Tuple

import torch

from ..errors import OptionTypeError, TraceFileError
from .encode import document, tensors

MANIFEST = "trace.json"
EVENTS = "events.jsonl"
TENSORS = "tensors.safetensors"
_JSON_LIMIT = 1 << 30  # no document of a forward comes near a gigabyte of JSON
_TENSOR_LIMIT = 1 << 40


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(row, allow_nan=False, separators=(",", ":")) + "\n" for row in rows).encode()


def _fresh_storage(stored: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Contiguous tensors that share no memory, as the tensor file requires (copies only where needed)."""
    out, seen = {}, set()
    for name, tensor in stored.items():
        tensor = tensor.contiguous()
        key = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        if key is not None and key in seen:
            tensor = tensor.clone()
        elif key is not None:
            seen.add(key)
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()  # a view into a larger storage: only its own elements are written
        out[name] = tensor
    return out


def save(recording, path) -> str:
    """Write `recording` to `path` (a `.tl` file by convention); returns the path written."""
    if not isinstance(path, (str, os.PathLike)):
        raise OptionTypeError(f"save(path) takes a file path, got {type(path).__name__}")
    from safetensors.torch import save as safetensors_bytes

    doc = document(recording)
    stored, how, output = tensors(recording)
    doc["output"] = output
    doc["tensors"] = how  # how each tensor was stored when not as itself, or why it was left out
    forward_events = doc.pop("events")
    backward_events = [run.pop("events") for run in doc["backward"]]
    path = os.fspath(path)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(MANIFEST, json.dumps(doc, allow_nan=False, indent=1))
        archive.writestr(EVENTS, _jsonl(forward_events))
        for k, rows in enumerate(backward_events):
            archive.writestr(f"backward-{k}.jsonl", _jsonl(rows))
        archive.writestr(TENSORS, safetensors_bytes(_fresh_storage(stored), metadata={"format": doc["format"]}))
    return path


def _read(archive: zipfile.ZipFile, name: str, limit: int) -> bytes:
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise TraceFileError(f"the archive has no {name}: not a trace torchlens saved") from None
    if info.file_size > limit:
        raise TraceFileError(f"{name} claims {info.file_size} bytes, more than a saved trace holds")
    return archive.read(info)


def _json(data: bytes, name: str):
    try:
        return json.loads(data)
    except ValueError as exc:
        raise TraceFileError(f"{name} is not JSON ({exc})") from None


def _jsonl_rows(data: bytes, name: str) -> list:
    return [_json(line, name) for line in data.splitlines() if line.strip()]


def read(path) -> Tuple[dict, Dict[str, torch.Tensor], Dict[str, str]]:
    """(document with its events back in place, tensors by name, how each was stored)."""
    if not isinstance(path, (str, os.PathLike)):
        raise OptionTypeError(f"load(path) takes a file path, got {type(path).__name__}")
    from safetensors import SafetensorError
    from safetensors.torch import load as safetensors_load

    try:
        archive = zipfile.ZipFile(os.fspath(path))
    except zipfile.BadZipFile:
        raise TraceFileError(f"{os.fspath(path)!r} is not a zip archive: not a trace torchlens saved "
                             f"(save one with trace.save(path))") from None
    with archive:
        doc = _json(_read(archive, MANIFEST, _JSON_LIMIT), MANIFEST)
        if not isinstance(doc, dict) or not isinstance(doc.get("backward", []), list):
            raise TraceFileError(f"{MANIFEST} is not a saved trace's document")
        doc["events"] = _jsonl_rows(_read(archive, EVENTS, _JSON_LIMIT), EVENTS)
        for k, run in enumerate(doc.get("backward", [])):
            if not isinstance(run, dict):
                raise TraceFileError(f"{MANIFEST}: backward {k} is not an object")
            run["events"] = _jsonl_rows(_read(archive, f"backward-{k}.jsonl", _JSON_LIMIT), f"backward-{k}.jsonl")
        try:
            stored = safetensors_load(_read(archive, TENSORS, _TENSOR_LIMIT))
        except (SafetensorError, ValueError, RuntimeError) as exc:
            raise TraceFileError(f"{TENSORS} is not a safetensors file ({exc})") from None
    how = doc.get("tensors", {})
    if not isinstance(how, dict) or not all(isinstance(v, str) for v in how.values()):
        raise TraceFileError(f"{MANIFEST}: 'tensors' should map tensor names to notes")
    return doc, stored, how
