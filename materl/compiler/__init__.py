"""The compiler: a recipe plus agents and options -> a plan (``plan``), run as a rollout stage
(``scheduler``) and a learner stage (``learner``) by ``compiled.Compiled``.

Op kinds and their implementations are in ``materl.compiler.kinds``, registered here into the
op table (``spec.OPS``) when the package is imported.
"""

from materl.compiler import kinds  # noqa: F401  (registers every op kind in spec.OPS)
