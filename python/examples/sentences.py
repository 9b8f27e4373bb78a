#!/usr/bin/env python3
"""Feeding a text-to-speech engine: whole sentences as soon as each one is complete, so speech
starts after the first sentence rather than after the whole answer.

    python3 sentences.py [BUS_ADDRESS]   # default: $LEANSTREAM_BUS, else the system bus
"""
import sys, leanstream

messages = [{"role": "user", "content": "Describe a robot arm in three sentences."}]
with leanstream.Client(sys.argv[1] if len(sys.argv) > 1 else None) as client:
    for sentence in client.chat("smollm2", messages, max_tokens=80, sentences=True):
        print("speak:", sentence.strip())   # hand it to your TTS engine here
