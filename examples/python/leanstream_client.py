#!/usr/bin/env python3
"""Stream a generation from leanstreamd over D-Bus with jeepney (pure Python, `pip install jeepney`).

    python3 leanstream_client.py --address unix:path=/tmp/bus --model smollm2 --prompt "Hello"
    python3 leanstream_client.py --model smollm2 --prompt "Pick up the cup." --json-schema action.json

--address takes a D-Bus address, or SYSTEM / SESSION; the default is $LEANSTREAM_BUS, else SYSTEM.
Exit status: 0 success, 1 the daemon refused or the stream failed, 3 the daemon cannot be reached.

The calls, with their D-Bus signatures (see docs/clients.md):
  Manager.OpenSession(s model, u context_tokens) -> o session
  Session.Generate(s prompt, (ududdtassssuu) params) -> h fd
  Session.Close()
Generate returns the read end of a pipe carrying one JSON object per line:
  {"token": {"id": 42, "text": "Hi"}} ... then {"done": {"reason": ..., "stats": {...}}}
  or {"error": {"name": "Cancelled", "message": ...}}. EOF before "done" means it broke.
"""

import argparse
import json
import os
import sys

from jeepney import DBusAddress, new_method_call
from jeepney.io.blocking import open_dbus_connection
from jeepney.wrappers import DBusErrorResponse, unwrap_msg

BUS_NAME = "io.github.leanstream.LeanStream1"
MANAGER_PATH = "/io/github/leanstream/LeanStream1"
MANAGER = BUS_NAME + ".Manager"
SESSION = BUS_NAME + ".Session"
ERROR_PREFIX = BUS_NAME + ".Error."
UNREACHABLE = {
    "org.freedesktop.DBus.Error.ServiceUnknown",
    "org.freedesktop.DBus.Error.NameHasNoOwner",
}


class StreamError(Exception):
    """The token stream ended with an error event or without a done event."""


def call(conn, address, method, signature=None, body=()):
    """Calls a method and returns its reply body; raises DBusErrorResponse for an error reply."""
    msg = new_method_call(address, method, signature, body)
    return unwrap_msg(conn.send_and_get_reply(msg))


def generate(conn, model, prompt, max_tokens=0, temperature=0.0, seed=0, context=0, out=sys.stdout,
             grammar_kind="", grammar=""):
    """Opens a session on `model`, streams the generation of `prompt` to `out`, closes the session.
    With grammar_kind "json_schema" and a schema's text as `grammar`, the output is JSON that
    validates against it (when the done reason is "eos"). Returns the `done` event's body."""
    manager = DBusAddress(MANAGER_PATH, bus_name=BUS_NAME, interface=MANAGER)
    (session_path,) = call(conn, manager, "OpenSession", "su", (model, context))
    session = DBusAddress(session_path, bus_name=BUS_NAME, interface=SESSION)
    try:
        # GenerateParams: max_tokens u, temperature d, top_k u, top_p d, repetition_penalty d,
        # seed t, stop as, grammar_kind s ("" or json_schema, lark, regex), grammar s,
        # priority s ("" = interactive), first-token and end deadlines in ms u u (0 = none).
        params = (max_tokens, float(temperature), 0, 1.0, 1.0, seed, [], grammar_kind, grammar,
                  "", 0, 0)
        (fd,) = call(conn, session, "Generate", "s(ududdtassssuu)", (prompt, params))
        with fd.to_file("rb") as stream:
            for raw in stream:
                if not raw.strip():
                    continue
                event = json.loads(raw)
                if "token" in event:
                    out.write(event["token"]["text"])
                    out.flush()
                elif "done" in event:
                    return event["done"]
                elif "error" in event:
                    err = event["error"]
                    raise StreamError(f"{err['name']}: {err['message']}")
        raise StreamError("the token stream ended without a done event")
    finally:
        try:
            call(conn, session, "Close")
        except DBusErrorResponse:
            pass  # Already gone; the daemon also closes it when we disconnect.


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=os.environ.get("LEANSTREAM_BUS", "SYSTEM"),
                        help="D-Bus address, or SYSTEM / SESSION (default: $LEANSTREAM_BUS or SYSTEM)")
    parser.add_argument("--model", required=True, help="model name in the daemon's model directory")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=0, help="0 = the daemon's default")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context", type=int, default=0, help="0 = the daemon's default")
    parser.add_argument("--json-schema", metavar="FILE",
                        help="constrain the output to JSON that validates against this schema")
    args = parser.parse_args(argv)
    grammar_kind, grammar = "", ""
    if args.json_schema:
        try:
            with open(args.json_schema, encoding="utf-8") as f:
                grammar_kind, grammar = "json_schema", f.read()
        except OSError as e:
            print(f"error: cannot read the schema {args.json_schema}: {e}", file=sys.stderr)
            return 1

    try:
        conn = open_dbus_connection(bus=args.address, enable_fds=True)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: cannot connect to the bus {args.address}: {e}", file=sys.stderr)
        return 3
    with conn:
        try:
            done = generate(conn, args.model, args.prompt, args.max_tokens, args.temperature,
                            args.seed, args.context, grammar_kind=grammar_kind, grammar=grammar)
        except DBusErrorResponse as e:
            message = e.data[0] if e.data else ""
            print(f"\nerror: {e.name}: {message}", file=sys.stderr)
            if e.name in UNREACHABLE:
                print("hint: is leanstreamd running on that bus?", file=sys.stderr)
                return 3
            return 1
        except StreamError as e:
            print(f"\nerror: {e}", file=sys.stderr)
            return 1
    stats = done["stats"]
    print()
    print(f"[{stats['generated_tokens']} tokens, stop: {done['reason']}, "
          f"{stats['decode_tokens_per_s']:.1f} tok/s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
