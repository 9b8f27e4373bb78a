#!/usr/bin/env python3
"""Writes engine/tests/fixtures/quant-blocks.json: random GGML blocks of every block type the
engine reads, with their values as the `gguf` Python package's dequantiser (an implementation
independent of the engine) decodes them. engine/tests/integration/quant_blocks.rs holds the engine's
decoders to these values.

    python3 -m venv .venv && .venv/bin/pip install numpy gguf
    .venv/bin/python scripts/reference/quant-blocks.py engine/tests/fixtures/quant-blocks.json

The bytes are seeded random (any bit pattern is a valid block) except the f16 scale fields,
which are set to finite values in [-1, 1] so that every decoded value is a finite number.
"""
import json
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

# type: (block bytes, byte offsets of its f16 scales)
LAYOUTS = {
    T.Q8_0: (34, [0]),
    T.Q4_0: (18, [0]),
    T.Q4_1: (20, [0, 2]),
    T.Q5_0: (22, [0]),
    T.Q5_1: (24, [0, 2]),
    T.Q2_K: (84, [80, 82]),
    T.Q3_K: (110, [108]),
    T.Q4_K: (144, [0, 2]),
    T.Q5_K: (176, [0, 2]),
    T.Q6_K: (210, [208]),
}
BLOCKS = 3


def main(out_path):
    rng = np.random.default_rng(20261201)
    cases = []
    for qtype, (size, scales) in LAYOUTS.items():
        raw = rng.integers(0, 256, size=(BLOCKS, size), dtype=np.uint8)
        for at in scales:
            d = rng.uniform(-1, 1, size=BLOCKS).astype(np.float16)
            raw[:, at:at + 2] = d.view(np.uint8).reshape(BLOCKS, 2)
        values = dequantize(raw.reshape(-1), qtype).astype(np.float32).reshape(-1)
        cases.append({
            "type": qtype.name.lower(),
            "bytes": raw.reshape(-1).tobytes().hex(),
            "values": [float(v) for v in values],
        })
    with open(out_path, "w") as f:
        json.dump({"generator": "scripts/reference/quant-blocks.py (gguf.quants.dequantize)",
                   "cases": cases}, f)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
