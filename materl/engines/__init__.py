"""Generation engines: the in-process Mojo and transformers engines and SGLang over HTTP,
registered in ``ENGINES`` here (explicitly: importing the package registers them)."""

from materl.engines import mojo_engine, sglang_engine, transformers_engine  # noqa: F401  (register the engines)
from materl.engines.base import ENGINES, Engine, Generation, SamplingParams

__all__ = ["ENGINES", "Engine", "Generation", "SamplingParams"]
