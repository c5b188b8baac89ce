"""The saved-trace file: a zip archive anyone can open with `unzip` and read without torchlens.

    trace.json          the recording's settings, header and footer, scopes, findings, the
                        attempted op of a failure, the forward's output (as data; tensors by name)
    events.jsonl        one JSON object per forward event, in order
    backward-K.jsonl    one per event of the K-th backward through the forward's graph
    tensors.safetensors kept values, output tensors and a repro's inputs (safetensors: a JSON
                        header, raw bytes)

Reading never unpickles, imports or calls anything named in the file. Sizes are checked before
anything is decompressed: the tensor file is stored uncompressed (float data gains nothing from
deflating, and a stored member cannot inflate), and a JSON member may grow to at most
`_JSON_LIMIT` bytes and `_JSON_RATIO` times its compressed size, so a small crafted archive cannot
make `tl.load` fill memory.
"""

from __future__ import annotations

import json
import os
import zipfile
from typing import Dict, List, Tuple

import torch

from ..errors import OptionTypeError, TraceFileError
from ..options import check_count
from .calls import REPRO_BYTES, call_doc
from .encode import document, tensors

__all__ = ["EVENTS", "MANIFEST", "TENSORS", "read", "save"]

MANIFEST = "trace.json"
EVENTS = "events.jsonl"
TENSORS = "tensors.safetensors"
_JSON_LIMIT = 1 << 28  # 256 MiB: a forward of a million events is ~150 MiB of JSON lines
_JSON_RATIO = 100  # JSON lines of events deflate about 10 to 30 times
_SMALL = 1 << 24  # below 16 MiB the ratio is not checked (a tiny file of repeated rows compresses well)


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


def save(recording, path, max_repro_bytes=None) -> str:
    """Write `recording` to `path` (a `.tl` file by convention); returns the path written. The
    inputs of the call its `repro()` replays are saved up to `max_repro_bytes` (None: `REPRO_BYTES`)."""
    if not isinstance(path, (str, os.PathLike)):
        raise OptionTypeError(f"save(path) takes a file path, got {type(path).__name__}")
    bound = check_count("save", "max_repro_bytes", max_repro_bytes, none_means=f"{REPRO_BYTES} bytes")
    from safetensors.torch import save as safetensors_bytes

    doc = document(recording)
    stored, how, output = tensors(recording)
    repro = call_doc(recording, REPRO_BYTES if bound is None else bound, stored, how)
    if repro is not None:
        doc["repro"] = repro
    doc["output"] = output
    doc["tensors"] = how  # how each tensor was stored when not as itself, or why it was left out
    forward_events = doc.pop("events")
    backward_events = [run.pop("events") for run in doc["backward"]]
    path = os.fspath(path)
    partial = f"{path}.{os.getpid()}.partial"  # written whole, then moved: a failure leaves the old file
    try:
        with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            archive.writestr(MANIFEST, json.dumps(doc, allow_nan=False, indent=1))
            archive.writestr(EVENTS, _jsonl(forward_events))
            for k, rows in enumerate(backward_events):
                archive.writestr(f"backward-{k}.jsonl", _jsonl(rows))
            archive.writestr(TENSORS, safetensors_bytes(_fresh_storage(stored), metadata={"format": doc["format"]}),
                             compress_type=zipfile.ZIP_STORED)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return path


def _read(archive: zipfile.ZipFile, name: str) -> bytes:
    """A member's bytes, once its claimed size is one a saved trace can have (zipfile never
    inflates a member past the size it claims)."""
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise TraceFileError(f"the archive has no {name}: not a trace torchlens saved") from None
    if name == TENSORS:
        if info.compress_type != zipfile.ZIP_STORED and info.file_size > max(_SMALL, 4 * info.compress_size):
            raise TraceFileError(f"{name} claims {info.file_size} bytes from {info.compress_size}: tensors saved by "
                                 f"torchlens are stored uncompressed")
    elif info.file_size > _JSON_LIMIT or info.file_size > max(_SMALL, _JSON_RATIO * info.compress_size):
        raise TraceFileError(f"{name} claims {info.file_size} bytes from {info.compress_size}: more than a saved "
                             f"trace holds")
    return archive.read(info)


def _json(data: bytes, name: str):
    try:
        return json.loads(data)
    except ValueError as exc:
        raise TraceFileError(f"{name} is not JSON ({exc})") from None


def _jsonl_rows(data: bytes, name: str) -> list:
    rows: List[dict] = []
    for line in data.splitlines():
        if line.strip():
            row = _json(line, name)
            if not isinstance(row, dict) or not isinstance(row.get("kind"), str):
                raise TraceFileError(f"{name}: line {len(rows) + 1} is not an event")  # refused at once, not at the end
            rows.append(row)
    return rows


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
        doc = _json(_read(archive, MANIFEST), MANIFEST)
        if not isinstance(doc, dict) or not isinstance(doc.get("backward", []), list):
            raise TraceFileError(f"{MANIFEST} is not a saved trace's document")
        doc["events"] = _jsonl_rows(_read(archive, EVENTS), EVENTS)
        for k, run in enumerate(doc.get("backward", [])):
            if not isinstance(run, dict):
                raise TraceFileError(f"{MANIFEST}: backward {k} is not an object")
            run["events"] = _jsonl_rows(_read(archive, f"backward-{k}.jsonl"), f"backward-{k}.jsonl")
        try:
            stored = safetensors_load(_read(archive, TENSORS))
        except (SafetensorError, ValueError, RuntimeError) as exc:
            raise TraceFileError(f"{TENSORS} is not a safetensors file ({exc})") from None
    how = doc.get("tensors", {})
    if not isinstance(how, dict) or not all(isinstance(v, str) for v in how.values()):
        raise TraceFileError(f"{MANIFEST}: 'tensors' should map tensor names to notes")
    return doc, stored, how
