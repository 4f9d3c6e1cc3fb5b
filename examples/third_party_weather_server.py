"""A stand-in for a third-party MCP server: it imports only the `mcp` SDK, nothing from materl.

    python examples/third_party_weather_server.py     # speaks MCP over stdio

The forecast is made up (deterministic, no network) so the example runs anywhere.
"""

import hashlib

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

app = MCPServer("weather", log_level="WARNING")
CITIES = ("Lisbon", "Oslo", "Paris", "Tokyo")


@app.tool()
def get_forecast(city: str, days: int = 1) -> str:
    """Daily weather forecast for a city (1 to 5 days)."""
    if city not in CITIES:
        raise ToolError(f"unknown city {city!r}; known cities: {', '.join(CITIES)}")
    if not 1 <= days <= 5:
        raise ToolError(f"days must be 1 to 5, got {days}")
    lines = []
    for day in range(days):
        h = hashlib.sha256(f"{city}/{day}".encode()).digest()
        sky = ("sunny", "cloudy", "rain", "snow")[h[0] % 4]
        lines.append(f"day {day + 1}: {sky}, {h[1] % 25 + 5} C")
    return f"{city}\n" + "\n".join(lines)


if __name__ == "__main__":
    app.run()
