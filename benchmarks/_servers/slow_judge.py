"""An OpenAI-compatible judge that waits ``--latency`` seconds, then answers ``Score: 1``: the
latency of a remote judge model, without the model. Prints its base URL, then serves on
127.0.0.1 until killed.

    python benchmarks/_servers/slow_judge.py --latency 0.2
"""

import argparse
import asyncio
import socket

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--latency", type=float, default=0.2)
    args = p.parse_args()

    async def chat(request):
        await request.json()
        await asyncio.sleep(args.latency)
        return JSONResponse({"id": "slow", "object": "chat.completion", "created": 0, "model": "slow-judge",
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": "Score: 1"}}]})

    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    print(f"http://127.0.0.1:{sock.getsockname()[1]}/v1", flush=True)
    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    uvicorn.Server(uvicorn.Config(app, log_level="warning", backlog=512)).run(sockets=[sock])


if __name__ == "__main__":
    main()
