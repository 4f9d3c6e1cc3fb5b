"""A test MCP server that fails in every way a real one can, on request.

    python tests/tools/faulty_server.py                 # stdio
    python tests/tools/faulty_server.py --http PORT     # streamable HTTP at http://127.0.0.1:PORT/mcp

It speaks MCP's JSON-RPC itself, with the standard library only (like a server written in
another language would), so it can break the protocol in ways the SDK's server never does.
Calls run concurrently. Tools:

- ``work(fault="none", seconds=0, size=0)``: the benchmark's tool; ``fault`` is one of the
  names below, applied to this call.
- ``crash``: the process exits mid-call (``os._exit``).
- ``hang``: this call never answers; the server keeps serving others.
- ``freeze``: the whole server stops answering and reading, without closing its pipes or sockets.
- ``garbage``: the answer to this call is not a valid MCP result (stdio: a JSON-RPC response
  whose ``content`` is not a list; HTTP: a body that is not JSON).
- ``noise``: a line that is not JSON-RPC on stdout, then the real answer.
- ``bad_utf8``: the answer's text contains bytes that are not UTF-8.
- ``surrogate``: the answer's text contains an escaped lone surrogate (``"\\ud800"``).
- ``huge``: a text of ``size`` bytes.   ``slow``: answers after ``seconds``.
- ``error``: an MCP error result (``isError``).   ``rpc_error``: a JSON-RPC error answer.
- ``echo(text)``, ``pid()``, ``cwd()`` (its working directory), ``argv()`` (its arguments, JSON),
  and per-process state:
  ``insert(value, seconds=0)`` (appends after ``seconds``), ``total()``.
  Every tool but ``insert`` declares ``idempotentHint`` (MCP tool annotations): the Toolbox retries
  those, not ``insert``, when the server dies under them.

``--start-delay S`` makes start-up slow; ``--fail-start`` exits before serving, and
``--fail-start-if-exists PATH`` does when PATH exists (a server that stops coming back).
``--bad-schema`` adds a tool ``broken`` whose input schema is not a valid JSON Schema.
"""

import asyncio
import json
import os
import sys
import time

FAULTS = ("none", "crash", "hang", "freeze", "garbage", "noise", "bad_utf8", "surrogate", "huge", "slow",
          "error", "rpc_error")
_STR, _NUM, _INT = {"type": "string"}, {"type": "number"}, {"type": "integer"}


def _tool(name, props=None, required=()):
    # every tool but insert declares that running it again is harmless (retried after a crash)
    return {"name": name, "description": f"The {name} tool.",
            "inputSchema": {"type": "object", "properties": props or {}, "required": list(required)},
            "annotations": {"idempotentHint": name != "insert"}}


TOOLS = [_tool("work", {"fault": {**_STR, "enum": list(FAULTS)}, "seconds": _NUM, "size": _INT}),
         *(_tool(f) for f in FAULTS if f not in ("none", "slow", "huge")),
         _tool("slow", {"seconds": _NUM}, ["seconds"]), _tool("huge", {"size": _INT}, ["size"]),
         _tool("echo", {"text": _STR}, ["text"]), _tool("pid"), _tool("insert", {"value": _INT, "seconds": _NUM}, ["value"]),
         _tool("total"), _tool("cwd"), _tool("argv")]
BROKEN = {**_tool("broken", {"x": {"type": "no-such-type"}}), "description": "A tool with an invalid schema."}
ROWS: list[int] = []
FROZEN = asyncio.Event()


def _text(text, is_error=False):
    return {"content": [{"type": "text", "text": text}], "isError": is_error}


async def call_tool(name, args, raw):
    """The result dict of one tools/call, or raw bytes to send instead of a normal response."""
    fault = args.get("fault", "none") if name == "work" else name
    if fault == "crash":
        os._exit(3)
    if fault in ("hang", "freeze"):
        if fault == "freeze":
            FROZEN.set()
        await asyncio.Event().wait()
    if fault in ("slow", "none") and float(args.get("seconds", 0)) > 0:
        await asyncio.sleep(float(args["seconds"]))
    if fault == "garbage":
        return raw("garbage")
    if fault == "bad_utf8":
        return raw("bad_utf8")
    if fault == "surrogate":
        return _text("lone \ud800 surrogate")
    if fault == "huge":
        return _text("x" * int(args.get("size", 1 << 20)))
    if fault == "error":
        return _text("the tool failed on purpose", is_error=True)
    if fault == "rpc_error":
        raise LookupError("the server refused the request on purpose")
    if name == "echo":
        return _text(args["text"])
    if name == "pid":
        return _text(str(os.getpid()))
    if name == "cwd":
        return _text(os.getcwd())
    if name == "argv":
        return _text(json.dumps(sys.argv[1:]))
    if name == "insert":  # a side effect: not idempotent (after ``seconds``, so it can be in flight)
        await asyncio.sleep(float(args.get("seconds", 0)))
        ROWS.append(int(args["value"]))
        return _text(f"inserted; {len(ROWS)} rows")
    if name == "total":
        return _text(json.dumps({"rows": len(ROWS), "sum": sum(ROWS)}))
    return _text(f"done: {name} {fault}")


async def handle(msg):
    """The response dict for one JSON-RPC message (None for notifications)."""
    method, rid, params = msg.get("method"), msg.get("id"), msg.get("params") or {}
    if rid is None:
        return None
    if method == "initialize":
        result = {"protocolVersion": params.get("protocolVersion", "2025-06-18"), "capabilities": {"tools": {}},
                  "serverInfo": {"name": "faulty", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": TOOLS}
    elif method == "ping":
        result = {}
    elif method == "tools/call":
        try:
            result = await call_tool(params.get("name"), params.get("arguments") or {}, lambda kind: (kind, rid))
        except LookupError as exc:
            return {"jsonrpc": "2.0", "id": rid, "error": {"code": -32000, "message": str(exc)}}
    else:
        return {"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": f"method not found: {method}"}}
    return {"jsonrpc": "2.0", "id": rid, "result": result}


def encode(response, *, http=False):
    """Wire bytes of a response; ``(kind, id)`` tuples are the deliberate protocol breaks."""
    if isinstance(response.get("result"), tuple):
        kind, rid = response["result"]
        if kind == "garbage":
            return b"this is not JSON at all {{{" if http else \
                (json.dumps({"jsonrpc": "2.0", "id": rid, "result": {"content": "not a list"}}) + "\n").encode()
        body = json.dumps({"jsonrpc": "2.0", "id": rid, "result": _text("MARK")}).encode()
        return body.replace(b"MARK", b"caf\xe9 \xff\xfe bytes") + (b"" if http else b"\n")
    data = json.dumps(response).encode()
    return data if http else data + b"\n"


# -- stdio --------------------------------------------------------------------------------------

async def serve_stdio():
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout.buffer
    tasks = set()

    async def one(line):
        msg = json.loads(line)
        if msg.get("method") == "tools/call" and (msg.get("params") or {}).get("name") == "noise":
            out.write(b"\x00 this line is not JSON-RPC\n")
            out.flush()
        response = await handle(msg)
        if response is not None and not FROZEN.is_set():
            out.write(encode(response))
            out.flush()

    while not FROZEN.is_set():
        line = await reader.readline()
        if not line:
            return
        task = asyncio.ensure_future(one(line))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.Event().wait()  # frozen: never read, never answer, never exit


# -- streamable HTTP (JSON responses, no sessions) ----------------------------------------------

async def serve_http(port):
    async def connection(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method = lines[0].split(" ")[0]
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if FROZEN.is_set():
                    await asyncio.Event().wait()
                if method != "POST":
                    await reply(writer, 405 if method == "GET" else 200, b"", "text/plain")
                    continue
                response = await handle(json.loads(body))
                if FROZEN.is_set():
                    await asyncio.Event().wait()
                if response is None:
                    await reply(writer, 202, b"", "text/plain")
                else:
                    await reply(writer, 200, encode(response, http=True), "application/json")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def reply(writer, status, body, content_type):
    reason = {200: "OK", 202: "Accepted", 405: "Method Not Allowed"}[status]
    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                 f"\r\n".encode() + body)
    await writer.drain()


def main(argv):
    if "--start-delay" in argv:
        time.sleep(float(argv[argv.index("--start-delay") + 1]))
    flag = argv[argv.index("--fail-start-if-exists") + 1] if "--fail-start-if-exists" in argv else None
    if "--fail-start" in argv or (flag and os.path.exists(flag)):
        print("faulty_server: failing at start on purpose", file=sys.stderr)
        sys.exit(7)
    if "--bad-schema" in argv:
        TOOLS.append(BROKEN)
    if "--http" in argv:
        asyncio.run(serve_http(int(argv[argv.index("--http") + 1])))
    else:
        asyncio.run(serve_stdio())


if __name__ == "__main__":
    main(sys.argv[1:])
