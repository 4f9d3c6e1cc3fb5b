"""materl: an asyncio dataflow engine for agentic, tool-use RL of LLMs."""

from materl.errors import *  # noqa: F403
from materl.registry import Registry

__version__ = "0.1.0"
