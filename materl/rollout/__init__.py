"""Multi-turn episodes with exact token ids, tool-call formats and tool servers (MCP, Python).
Importing the package registers every tool-call format (``tool_formats``) in
``parsers.TOOL_PARSERS``."""

from materl.rollout import tool_formats  # noqa: F401  (registers qwen3_coder, llama3_json, mistral, harmony)
