"""Generation engines: the in-process transformers engine, the in-process Mojo engine and SGLang
over HTTP (registered in ``ENGINES`` on import)."""

from materl.engines.base import ENGINES, Engine, Generation, SamplingParams

__all__ = ["ENGINES", "Engine", "Generation", "SamplingParams"]


def load_all() -> None:
    import materl.engines.mojo_engine  # noqa: F401
    import materl.engines.sglang_engine  # noqa: F401
    import materl.engines.transformers_engine  # noqa: F401
