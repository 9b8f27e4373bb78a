#!/usr/bin/env python3
"""A robot-arm planner: a streamed chat whose answer must be JSON matching a schema, at
background priority (it yields to interactive work on the same daemon).

    python3 planner.py [BUS_ADDRESS]     # default: $LEANSTREAM_BUS, else the system bus
"""
import sys, leanstream

schema = {"type": "object", "required": ["action", "object"],
          "properties": {"action": {"enum": ["pick", "place"]}, "object": {"type": "string"}}}
messages = [{"role": "system", "content": "You plan robot arm actions. Answer in JSON."},
            {"role": "user", "content": "Put the red cup on the shelf."}]
with leanstream.Client(sys.argv[1] if len(sys.argv) > 1 else None) as client:
    for piece in client.chat("smollm2", messages, schema=schema, priority="background"):
        print(piece, end="", flush=True)
print()
