"""Carry a GGUF to a machine that takes fewer bytes than the file has: its header, its non-layer
tensors and its first K layers (in file order), with the other layers rebuilt there as byte copies
of those K. The rebuilt file has the original's size, layout, tensor types and speed, not its texts:
for benchmarks on a device loan (64 MiB a call), never for outputs.

    python scripts/gguf_carry.py pack SRC.gguf FOLDER [--layers 3]   here: FOLDER/{prefix,rest}.bin, table.json
    python scripts/gguf_carry.py unpack FOLDER DEST_DIR              there: prints the rebuilt file's path

SmolLM2-135M-Instruct Q4_1 (98 MB) packs into 38.5 MB with three layers. ``pack`` needs the
``gguf`` package; ``unpack`` only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

LAYER = re.compile(r"blk\.(\d+)\.(.*)")


def _layer_order(tensors: list[Any]) -> list[int]:
    order: list[int] = []
    for t in tensors:
        m = LAYER.match(t.name)
        if m and int(m.group(1)) not in order:
            order.append(int(m.group(1)))
    return order


def pack(src: str, folder: str, layers: int) -> None:
    from gguf import GGUFReader

    tensors = sorted(GGUFReader(src).tensors, key=lambda t: t.data_offset)
    order = _layer_order(tensors)
    if not 0 < layers < len(order):
        raise SystemExit(f"--layers must be between 1 and {len(order) - 1}; got {layers}")
    cut = min(t.data_offset for t in tensors if t.name.startswith(f"blk.{order[layers]}."))
    offsets = {t.name: int(t.data_offset) for t in tensors}
    table, rest = [], bytearray()
    with open(src, "rb") as fh:
        for t in tensors:
            entry: dict[str, Any] = {"name": t.name, "off": int(t.data_offset), "n": int(t.n_bytes)}
            m = LAYER.match(t.name)
            if t.data_offset >= cut and m:
                entry["src"] = offsets[f"blk.{order[int(m.group(1)) % layers]}.{m.group(2)}"]
            elif t.data_offset >= cut:
                fh.seek(t.data_offset)
                entry["rest"] = len(rest)
                rest += fh.read(t.n_bytes)
            table.append(entry)
        fh.seek(0)
        prefix = fh.read(cut)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "prefix.bin"), "wb") as out:
        out.write(prefix)
    with open(os.path.join(folder, "rest.bin"), "wb") as out:
        out.write(rest)
    meta = {"size": os.path.getsize(src), "cut": cut, "name": os.path.basename(src), "table": table}
    with open(os.path.join(folder, "table.json"), "w", encoding="utf-8") as out:
        json.dump(meta, out)


def unpack(folder: str, dest: str) -> str:
    with open(os.path.join(folder, "table.json"), encoding="utf-8") as fh:
        meta = json.load(fh)
    with open(os.path.join(folder, "prefix.bin"), "rb") as fh:
        prefix = fh.read()
    with open(os.path.join(folder, "rest.bin"), "rb") as fh:
        rest = fh.read()
    buf = bytearray(meta["size"])
    buf[: len(prefix)] = prefix
    for e in meta["table"]:
        if e["off"] >= meta["cut"]:
            data = prefix[e["src"]: e["src"] + e["n"]] if "src" in e else rest[e["rest"]: e["rest"] + e["n"]]
            buf[e["off"]: e["off"] + e["n"]] = data
    os.makedirs(dest, exist_ok=True)
    path = os.path.join(dest, meta["name"])
    with open(path + ".part", "wb") as out:
        out.write(buf)
    os.replace(path + ".part", path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack")
    p.add_argument("src")
    p.add_argument("folder")
    p.add_argument("--layers", type=int, default=3)
    u = sub.add_parser("unpack")
    u.add_argument("folder")
    u.add_argument("dest")
    args = ap.parse_args()
    if args.command == "pack":
        pack(args.src, args.folder, args.layers)
    else:
        print(unpack(args.folder, args.dest))


if __name__ == "__main__":
    main()
