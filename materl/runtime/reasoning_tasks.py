"""reasoning-gym's procedural tasks as materl datasets, scored by the task's own checker.

    task = ReasoningGymTask("basic_arithmetic", options={"operators": ["+", "-"]}, level=1, seed=0)
    train_rows, test_rows = task.split(256, 32)      # seeded, offline, disjoint questions
    recipe = ml.replace(grpo, "rewards", lambda g: task.reward())   # reward/reasoning_gym in metrics
    task.knobs                                        # {"num_terms": [2, 3, 4, 5, 6], "num_digits": [1, 2, 3, 4]}

In a config (``data.source: reasoning_gym:basic_arithmetic``, ``data.params`` the task's options,
``data.level`` a fixed difficulty) or ``ml.train_rlhf(dataset="reasoning_gym:basic_arithmetic")``
the task's scorer replaces the recipe's rewards unless ``rewards`` are given.

A row is ``{"prompt": question + instruction, "answer": the oracle answer, "rg_entry": {question,
answer, metadata}}``; the ``reasoning_gym`` reward takes the text between the completion's last
``<answer>`` tags (reasoning-gym's ``extract_answer``) and calls the task's ``score_answer`` on
it with ``rg_entry``: a number in [0, 1] (1 = correct; some tasks give partial credit).

Difficulty knobs are the task's own curriculum attributes (reasoning-gym's ``coaching``
module): level L sets every attribute to its L-th value (the last one where it has fewer), as
``BaseCurriculum.set_global_level`` does; ``levels`` is the longest attribute's length. A task
with knobs satisfies ``materl.runtime.curriculum.Knobbed`` (``levels``, ``rows_at``,
``score_key``), so ``ml.train(..., curriculum=ml.Curriculum(...))`` can move it.
(reasoning-gym's ``CurriculumExperiment`` moves each attribute on a score board; verifiers'
``load_environment`` wraps the same generators. Deliberate difference: one global level, moved
by materl's curriculum from the running pass rate, its state in checkpoints.)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from materl.errors import ConfigError, MaterlError, UnknownNameError
from materl.ops.rewards import REWARDS
from materl.validation import did_you_mean

PREFIX = "reasoning_gym:"  # data.source / train_rlhf(dataset=) form
REWARD = "reasoning_gym"  # the registered reward, and the term's name in metrics (reward/reasoning_gym)
SCORE_KEY = f"reward/{REWARD}"  # the episode metric the curriculum reads
INSTRUCTION = "Give only the final answer between <answer> and </answer>."
_RESERVED = ("seed", "size")  # config fields materl sets itself


class ReasoningGymMissing(MaterlError, ImportError):
    """``reasoning_gym`` is not installed (it comes with the ``envs`` extra)."""


def _rg():
    try:
        import reasoning_gym
        from reasoning_gym import factory
    except ImportError as e:
        raise ReasoningGymMissing(f"reasoning-gym tasks need the reasoning_gym package ({e}): "
                                  f"pip install \"materl[envs]\"") from None
    return reasoning_gym, factory


def task_names() -> list[str]:
    """Every task reasoning-gym registers (``reasoning_gym:<name>`` accepts these)."""
    return sorted(_rg()[1].DATASETS)


def is_task_source(source: Any) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def task_from_source(source: str, *, options: Mapping[str, Any] | None = None, level: int | None = None,
                     seed: int = 0) -> ReasoningGymTask:
    """The task ``reasoning_gym:<name>`` names; ConfigError listing the tasks for a bad name."""
    return ReasoningGymTask(source[len(PREFIX):], options=options, level=level, seed=seed)


class ReasoningGymTask:
    """One reasoning-gym task with fixed ``options`` (its config dataclass's fields) at an
    optional difficulty ``level``; see the module docstring. ``instruction`` is appended to
    every question (None: the question alone). ``shots``: that many worked examples of the task
    (questions from stream ``seed + 2`` at the row's level, answered ``<answer>...</answer>``) as
    chat turns before the question, so that a small model sees the answer format."""

    def __init__(self, task: str, *, options: Mapping[str, Any] | None = None, level: int | None = None,
                 seed: int = 0, instruction: str | None = INSTRUCTION, shots: int = 0):
        _, factory = _rg()
        if task not in factory.DATASETS:
            names = sorted(factory.DATASETS)
            raise UnknownNameError(f"unknown reasoning-gym task {task!r}{did_you_mean(task, names)}; "
                                   f"{len(names)} tasks: {', '.join(names)}")
        if not isinstance(shots, int) or isinstance(shots, bool) or shots < 0:
            raise ConfigError(f"shots={shots!r}; accepted: an integer >= 0 (worked examples before each question)")
        self.task, self.seed, self.instruction, self.shots = task, int(seed), instruction, shots
        self._config_cls = factory.DATASETS[task][1]
        self.options = dict(options or {})
        fields = {f.name for f in dataclasses.fields(self._config_cls)} - set(_RESERVED)
        unknown = sorted(set(self.options) - fields)
        if unknown:
            raise ConfigError(f"reasoning-gym task {task!r} has no option {', '.join(map(repr, unknown))}"
                              f"{did_you_mean(unknown[0], sorted(fields))}; its options: {self.describe_options()}")
        self._curriculum = factory.create_curriculum(task) if factory.has_curriculum(task) else None
        clash = sorted(set(self.options) & set(self._knob_fields()))
        if clash and level is not None:
            raise ConfigError(f"reasoning-gym task {task!r}: options {', '.join(map(repr, clash))} are set by its "
                              f"difficulty knobs at level={level}; drop them from the options or drop the level")
        self.level = None if level is None else self._check_level(level)
        self.config(self.level)  # the options are valid (the task's own validate())

    # -- difficulty knobs (materl.runtime.curriculum.Knobbed) ------------------------------------

    @property
    def knobs(self) -> dict[str, list]:
        """The task's difficulty attributes and their values, easiest first ({} without any)."""
        attrs = self._curriculum.attributes if self._curriculum is not None else {}
        return {name: list(a.levels) for name, a in attrs.items()}

    @property
    def levels(self) -> int:
        """How many difficulty levels the knobs give (0: the task declares none)."""
        return max((len(v) for v in self.knobs.values()), default=0)

    score_key = SCORE_KEY

    def rows_at(self, level: int, n: int, *, seed: int) -> list[dict]:
        """``n`` rows at difficulty ``level`` from the stream ``seed``."""
        return self.rows(n, seed=seed, level=self._check_level(level))

    def _check_level(self, level: Any) -> int:
        if self.levels == 0:
            raise ConfigError(f"reasoning-gym task {self.task!r} declares no difficulty knobs (no curriculum), so "
                              f"level={level!r} has no meaning; tasks with knobs: {', '.join(tasks_with_knobs())}")
        if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level < self.levels:
            raise ConfigError(f"level={level!r} for reasoning-gym task {self.task!r}; accepted: 0..{self.levels - 1} "
                              f"(knobs: {self.knobs})")
        return level

    def _knob_fields(self) -> list[str]:
        out = []
        for a in (self._curriculum.attributes.values() if self._curriculum is not None else ()):
            out += [getattr(a, f) for f in ("field_name", "lower_field_name", "upper_field_name") if hasattr(a, f)]
        return out

    # -- rows ----------------------------------------------------------------------------------

    def config(self, level: int | None = None) -> Any:
        """The task's config dataclass for ``level`` (None: the options alone); ConfigError with
        the task's own message when its ``validate()`` refuses the options."""
        try:
            if level is None:
                config = self._config_cls(**self.options)
            else:
                self._curriculum.set_global_level(level)
                config = self._curriculum.generate_configuration(defaults=self.options)
            if hasattr(config, "validate"):
                config.validate()
        except (AssertionError, TypeError, ValueError) as e:
            raise ConfigError(f"reasoning-gym task {self.task!r} refuses options {self.options}"
                              f"{'' if level is None else f' at level {level}'}: {e or type(e).__name__}; "
                              f"its options: {self.describe_options()}") from None
        return config

    def describe_options(self) -> str:
        fields = [f for f in dataclasses.fields(self._config_cls) if f.name not in _RESERVED]
        return ", ".join(f"{f.name}={_default(f)!r}" for f in fields) or "(none)"

    def rows(self, n: int, *, seed: int | None = None, level: int | None = None,
             exclude: frozenset[str] = frozenset()) -> list[dict]:
        """``n`` rows (see the module docstring) from the stream ``seed`` (default the task's)
        at ``level`` (default the task's); questions in ``exclude`` are skipped."""
        level = self.level if level is None else level
        config = self.config(level)
        seed = self.seed if seed is None else int(seed)
        dataset_cls = _rg()[1].DATASETS[self.task][0]
        out, seen, i, size, dataset = [], set(exclude), 0, max(1, n + len(exclude)), None
        while len(out) < n:
            if dataset is None or i >= size:  # an entry depends on (seed, index) alone, not on size
                if dataset is not None:
                    if size >= 64 * n + 1024:
                        raise ConfigError(f"reasoning-gym task {self.task!r} with options {self.options} gives only "
                                          f"{len(out)} distinct questions of the {n} asked for; ask for fewer rows")
                    size *= 2
                dataset = dataset_cls(config=dataclasses.replace(config, seed=seed, size=size))
            entry, i = dataset[i], i + 1
            if entry["question"] not in seen:
                seen.add(entry["question"])
                out.append(self._row(entry, level))
        return out

    def split(self, train_size: int | None, test_size: int) -> tuple[list[dict], list[dict]]:
        """Disjoint train and held-out rows: held-out from stream ``seed + 1``, train from
        ``seed`` without the held-out questions (``train_size=None``: 256)."""
        test = self.rows(test_size, seed=self.seed + 1) if test_size else []
        train = self.rows(train_size or 256, exclude=frozenset(r["rg_entry"]["question"] for r in test))
        return train, test

    def _row(self, entry: Mapping[str, Any], level: int | None) -> dict:
        question = entry["question"]
        prompt = self._ask(question)
        if self.shots:
            prompt = [*(dict(t) for t in self._worked(level)), {"role": "user", "content": prompt}]
        metadata = dict(entry.get("metadata") or {})
        metadata.setdefault("source_dataset", self.task)
        return {"prompt": prompt, "answer": str(entry["answer"]),
                "rg_entry": {"question": question, "answer": entry["answer"], "metadata": metadata}}

    def _ask(self, question: str) -> str:
        return f"{question}\n\n{self.instruction}" if self.instruction else question

    @functools.lru_cache(maxsize=8)  # noqa: B019 - a handful of levels per task object
    def _worked(self, level: int | None) -> tuple[dict, ...]:
        """``shots`` worked examples at ``level`` as chat turns (stream ``seed + 2``)."""
        config = dataclasses.replace(self.config(level), seed=self.seed + 2, size=self.shots)
        dataset = _rg()[1].DATASETS[self.task][0](config=config)
        turns: list[dict] = []
        for i in range(self.shots):
            entry = dataset[i]
            turns += [{"role": "user", "content": self._ask(entry["question"])},
                      {"role": "assistant", "content": f"<answer>{entry['answer']}</answer>"}]
        return tuple(turns)

    # -- reward --------------------------------------------------------------------------------

    def reward(self, *, weight: float = 1.0):
        """The task's scorer as a recipe reward term (``reward/reasoning_gym`` in metrics)."""
        from materl.graph.constructors import reward

        return reward(REWARD, weight=weight, name=REWARD)

    def __repr__(self) -> str:
        return f"ReasoningGymTask({self.task!r}, options={self.options}, level={self.level}, seed={self.seed})"


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def tasks_with_knobs() -> list[str]:
    return sorted(_rg()[1].CURRICULA)


@functools.lru_cache(maxsize=None)
def _scorer(task: str):
    _, factory = _rg()
    if task not in factory.DATASETS:
        raise UnknownNameError(f"rg_entry names reasoning-gym task {task!r}, which is not registered")
    return factory.get_score_answer_fn(task)


@REWARDS.register(REWARD)
def reasoning_gym_score(*, completions: Sequence[str], rg_entry: Sequence[Mapping[str, Any]],
                        tag: str = "answer", **_: Any) -> list[float]:
    """reasoning-gym's own score of each completion: the text of its last ``<tag>...</tag>``
    (``reasoning_gym.utils.extract_answer``; none: scored as no answer) against ``rg_entry``
    (the row's ``{question, answer, metadata}``) by the task's ``score_answer``. (TRL/verl:
    reasoning-gym's README wires the same ``score_answer`` as a reward function.)"""
    from reasoning_gym.utils import extract_answer

    out = []
    for text, entry in zip(completions, rg_entry):
        task = entry["metadata"]["source_dataset"]
        out.append(float(_scorer(task)(extract_answer(text or "", tag_name=tag), entry)))
    return out
