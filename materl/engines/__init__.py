"""Generation engines: the in-process transformers engine and SGLang over HTTP, registered in
``ENGINES`` here (explicitly: importing the package registers them)."""

from materl.engines import sglang_engine, transformers_engine  # noqa: F401  (register "sglang", "transformers")
from materl.engines.base import ENGINES, Engine, Generation, SamplingParams

__all__ = ["ENGINES", "Engine", "Generation", "SamplingParams"]
