"""On-policy distillation in a recipe: the ``ml.distill_advantages`` constructor and the
``ml.with_distillation`` transform (compiler: ``materl.compiler.kinds.distill``; math:
``materl.ops.distill``; the pure recipe: ``materl.recipes.distill``)."""

from __future__ import annotations

from materl.errors import RecipeError
from materl.graph.constructors import logprobs
from materl.graph.kinds import facts
from materl.graph.node import Recipe, ref_node
from materl.graph.recipe import Graph, _finish
from materl.graph.trace import Builder, Placeholder, Value, active_builder, trace


def _number(what: str, value, low: float, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low \
            or (high is not None and not value <= high):
        span = f"in [{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        raise RecipeError(f"{what} must be a number {span}, got {value!r}")
    return float(value)


def distill_advantages(student_logprobs, teacher_logprobs, base=None, *, coef: float = 1.0, discount: float = 0.0,
                       completions=None, name: str | None = None) -> Value:
    """Per-token advantages ``base + discounted(-coef * (student - teacher log-prob))`` over the
    student's trained tokens (``materl.ops.distill``). ``student_logprobs``: the trainable
    policy's ``ml.logprobs`` (its sampling log-probs are the student's); ``teacher_logprobs``: a
    frozen agent's ``ml.logprobs`` of the same prompts and completions; ``base``: task advantages
    to add to (None: pure distillation); ``discount``: tinker-cookbook's ``kl_discount_factor``
    (0: each token's own reverse KL); ``completions``: the scored rollout (default: the latest)."""
    b = active_builder("ml.distill_advantages")
    coef = _number("ml.distill_advantages: coef", coef, 0.0)
    discount = _number("ml.distill_advantages: discount", discount, 0.0, 1.0)
    scored = completions if completions is not None else b.latest_completions("ml.distill_advantages")
    if scored is None:
        raise RecipeError(f"ml.distill_advantages needs generated completions earlier in recipe {b.name!r}")
    inputs = [scored, student_logprobs, teacher_logprobs] + ([base] if base is not None else [])
    return b.add("distill_advantages", inputs, {"coef": coef, "discount": discount}, scope="batch", name=name,
                 default_name="distill_advantages")


def with_distillation(base: Recipe, teacher: str = "teacher", weight: float = 1.0, *, discount: float = 0.0,
                      name: str | None = None) -> Recipe:
    """Add on-policy distillation to ``base``: the recipe gains an agent parameter ``teacher``
    (bound at compile time, frozen, same tokenizer as the policy), a ``teacher_logprobs`` node
    over the policy loss's own sequences, and its advantages become ``advantages +
    discounted(-weight * (student - teacher log-prob))`` per token (tinker-cookbook's
    ``kl_penalty_coef`` = ``weight``, ``kl_discount_factor`` = ``discount``). The old advantages
    node stays as ``<name>_prev``.

        distilled = ml.with_distillation(grpo, "teacher", 0.5)
        step = ml.compile(distilled, policy=student, ref_policy=ref, teacher=ml.Agent(...))
    """
    weight = _number("with_distillation: weight", weight, 0.0)
    if not isinstance(teacher, str) or not teacher.isidentifier():
        raise RecipeError(f"with_distillation: teacher is the name of a new agent parameter (e.g. 'teacher'), "
                          f"got {teacher!r}")
    if teacher in base.params:
        raise RecipeError(f"with_distillation: {base.where} already has a parameter {teacher!r}; "
                          f"name the teacher another way (params: {', '.join(base.params)})")
    losses = [n for n in base.nodes if facts(n).policy_gradient]
    if len(losses) != 1:
        raise RecipeError(f"with_distillation: {base.where} has {len(losses)} policy_loss nodes; it needs exactly "
                          f"one (nodes: {', '.join(n.name for n in base.nodes)})")
    loss, nodes = losses[0], base.node_map
    adv, student = ref_node(loss.inputs[0]), nodes.get(ref_node(loss.inputs[1]))
    if student is None or not facts(student).logprobs:
        raise RecipeError(f"with_distillation: policy loss {loss.name!r} reads %{loss.inputs[1]}, not ml.logprobs "
                          f"log-probs ({base.where})")
    prompts, completions = [Value(*_split(r)) for r in student.inputs if not r.startswith("@")][:2]

    builder = Builder(name or base.name, list(base.nodes), list(base.losses), [*base.params, teacher],
                      list(base.agents), dict(base.defaults))
    teacher_node = builder.unique(f"{teacher}_logprobs")

    def body(graph):
        teacher_logp = logprobs(Placeholder(teacher), prompts, completions, name=teacher_node)
        getattr(graph, adv).replace_with(distill_advantages(
            Value(student.name), teacher_logp, getattr(graph, adv), coef=weight, discount=discount,
            completions=completions))

    trace(body, builder, {"graph": Graph(builder)})
    shown = f"{teacher}, {weight:g}" + (f", discount={discount:g}" if discount else "")
    origin = f"with_distillation({shown}) of {base.name!r}"
    return _finish(builder, origin=origin, doc=base.doc)


def _split(ref: str) -> tuple[str, tuple[str, ...]]:
    head, *path = ref.split(".")
    return head, tuple(path)
