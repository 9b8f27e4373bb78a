#!/usr/bin/env python3
"""The asyncio client: two questions answered concurrently on one connection.

    python3 async_chat.py [BUS_ADDRESS]  # default: $LEANSTREAM_BUS, else the system bus
"""
import asyncio, sys, leanstream.aio


async def ask(client, question):
    gen = client.chat("smollm2", [{"role": "user", "content": question}], max_tokens=24)
    return "".join([piece async for piece in gen])


async def main(address):
    async with leanstream.aio.Client(address) as client:
        answers = await asyncio.gather(ask(client, "Name a color."), ask(client, "Name a fruit."))
        print(*answers, sep="\n")

asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else None))
