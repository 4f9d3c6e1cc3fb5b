"""The demo's generated questions (examples/arithmetic.py) and worked examples
(examples/calculator_tool_rl.py): exact answers, checked by the calculator server's own evaluator,
same seed same rows, and a held-out split disjoint from training."""

import importlib.util
import os
import re
import sys
from pathlib import Path

from materl.tools.calculator import evaluate

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    sys.path.insert(0, str(EXAMPLES))
    environ = dict(os.environ)  # the demo sets OMP_NUM_THREADS on import; keep it out of later tests
    try:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))
        os.environ.clear()
        os.environ.update(environ)


arithmetic = _load("arithmetic")


def test_rows_of_seed_0_computed_by_hand():
    rows = arithmetic.arithmetic_rows(6, seed=0)
    assert rows[0] == {"prompt": "What is the sum of 56125 and 6306?", "answer": "62431",
                       "expression": "56125 + 6306"}  # 56125 + 6306 = 62431
    assert rows[1] == {"prompt": "Subtract 9376 from 73691.", "answer": "64315",
                       "expression": "73691 - 9376"}  # the operands reversed: 73691 - 9376 = 64315
    assert rows[5] == {"prompt": "What is the sum of 33834 and 70804?", "answer": "104638",
                       "expression": "33834 + 70804"}  # 33834 + 70804 = 104638


def test_every_answer_is_the_calculators_value_and_the_question_holds_the_expressions_numbers():
    rows = arithmetic.arithmetic_rows(200, seed=5)
    assert {r["prompt"].split()[0] for r in rows} == {"Subtract", "What"}
    for r in rows:
        assert str(evaluate(r["expression"])) == r["answer"], r
        assert sorted(re.findall(r"\d+", r["prompt"])) == sorted(re.findall(r"\d+", r["expression"])), r
        assert not re.search(r"[-*+]", r["prompt"]), r  # said in words, not symbols
        if r["prompt"].startswith("Subtract"):
            a, b = map(int, re.findall(r"\d+", r["prompt"]))
            assert r["expression"] == f"{b} - {a}" and int(r["answer"]) > 0, r


def test_same_seed_same_rows_and_the_held_out_split_is_disjoint():
    assert arithmetic.arithmetic_rows(50, seed=3) == arithmetic.arithmetic_rows(50, seed=3)
    assert arithmetic.arithmetic_rows(50, seed=3) != arithmetic.arithmetic_rows(50, seed=4)
    train, test = arithmetic.train_test_split(100, 32, seed=0)
    assert len(train) == 100 and len(test) == 32
    assert not {r["expression"] for r in train} & {r["expression"] for r in test}
    assert len({r["expression"] for r in train}) == 100


def test_the_demos_worked_examples_show_correct_tool_results():
    demo = _load("calculator_tool_rl")
    turns = demo.EXAMPLES
    for i in range(0, len(turns), 4):
        user, call, tool, answer = turns[i:i + 4]
        expression = re.search(r'"expression": "([^"]+)"', call["content"]).group(1)
        assert tool["content"] == str(evaluate(expression)), (user, expression)
        assert answer["content"] == f"The answer is {tool['content']}."
