"""Any MCP server plugs into materl by its command line alone.

    python examples/third_party_mcp.py

`third_party_weather_server.py` knows nothing about materl (it imports only `mcp`). Here it is
started as a stdio subprocess, its tools are listed in the OpenAI function format that
`tokenizer.apply_chat_template(messages, tools=toolbox.tools)` takes, and it is called the
two ways an episode does: directly, and from a model's text through a tool-call parser.
Errors (an unknown city, a made-up tool) come back as results the model can read, never as
exceptions. A URL ("http://127.0.0.1:PORT/mcp") plugs in the same way.
"""

import asyncio
import json
import shlex
import sys
from pathlib import Path

from materl.rollout.mcp import mcp_tools  # exported as ml.mcp_tools
from materl.rollout.parsers import TOOL_PARSERS

SERVER = Path(__file__).resolve().with_name("third_party_weather_server.py")


async def main() -> None:
    command = f"{shlex.quote(sys.executable)} {shlex.quote(str(SERVER))}"
    async with mcp_tools(command, timeout_s=10) as toolbox:
        print("tools:", json.dumps(toolbox.tools, indent=2))

        result = await toolbox.call("get_forecast", {"city": "Paris", "days": 2})
        print(f"\nget_forecast(Paris, 2) -> error={result.is_error}, {result.latency_s * 1000:.1f} ms\n{result.content}")

        model_text = ('Let me check both. <tool_call>{"name": "get_forecast", "arguments": {"city": "Oslo"}}'
                      '</tool_call><tool_call>{"name": "get_forecast", "arguments": {"city": "Atlantis"}}'
                      '</tool_call><tool_call>{"name": "get_radar", "arguments": {}}</tool_call>')
        parsed = TOOL_PARSERS.get("hermes")(model_text)
        results = await asyncio.gather(*(toolbox.execute(call, episode_id="demo") for call in parsed.calls))
        for call, res in zip(parsed.calls, results):
            print(f"\n{call.name}({call.arguments}) -> error={res.is_error}\n{res.content}")


if __name__ == "__main__":
    asyncio.run(main())
