"""A reader for wandb's offline run files (`run-<id>.wandb`), so tests can check what a run
recorded without a server. The file is a 7-byte header (":W&B", magic 0xBEE1, a version byte)
then 32 KiB blocks of records, each framed by a CRC, a length and a type (full, or the first,
middle or last piece of a record split across blocks), holding a wandb `Record` protobuf."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32 * 1024
FRAME = 7  # crc32 (4), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B" or int.from_bytes(data[4:6], "little") != 0xBEE1:
        raise ValueError(f"{path} is not a wandb run file")
    position, pieces = 7, b""
    while position + FRAME <= len(data):
        if BLOCK - position % BLOCK < FRAME:  # the rest of a block is padding
            position += BLOCK - position % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + FRAME])
        payload = data[position + FRAME:position + FRAME + length]
        position += FRAME + length
        if kind in (FULL, FIRST):
            pieces = payload
        elif kind in (MIDDLE, LAST):
            pieces += payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record


def summary(path: Path) -> dict:
    """What a run recorded: its run record's fields, config, logged metrics, summary and exit
    code."""
    found: dict = {"config": {}, "history": [], "summary": {}, "exit_code": None}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            found.update(group=record.run.run_group, job_type=record.run.job_type,
                         tags=list(record.run.tags))
            for item in record.run.config.update:
                found["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                found["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            found["history"].append({(item.key or "/".join(item.nested_key)):
                                     json.loads(item.value_json) for item in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                found["summary"][item.key or "/".join(item.nested_key)] = json.loads(
                    item.value_json)
        elif kind == "exit":
            found["exit_code"] = record.exit.exit_code
    return found
