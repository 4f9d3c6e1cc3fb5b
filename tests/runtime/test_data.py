"""Dataset rows checked where they enter (``materl.runtime.data``, ``materl.runtime.prompts``):
every bad row named by file:line or index; reward columns; prompt length against the context."""

import pickle

import pytest

import materl as ml
from materl.errors import ConfigError, DataError
from materl.recipes import grpo
from materl.runtime.data import Row, Sampler, load_rows, split_columns
from materl.runtime.prompts import fit_prompts, prepare_rows, prompt_length, prompt_sites, reward_columns


@pytest.fixture(scope="module")
def step():
    s = ml.compile(grpo, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                   group_size=2, max_new_tokens=8)
    yield s
    s.close()


def test_jsonl_rows_remember_their_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    rows = load_rows(path)
    assert [r.origin for r in rows] == [f"{path}:1", f"{path}:3"]  # the blank line 2 is skipped, still counted
    assert rows[0] == {"prompt": "a", "answer": "1"} and "origin" not in rows[0]  # not a column
    assert split_columns(rows) == (["a", [{"role": "user", "content": "b"}]], {"answer": ["1", None]})
    again = pickle.loads(pickle.dumps(rows[1]))  # Ray ships rows to workers
    assert isinstance(again, Row) and again.origin == f"{path}:3" and again == rows[1]
    assert load_rows(rows)[1].origin == f"{path}:3"  # reloading keeps the file:line


def test_non_utf8_bytes_name_file_line_and_column(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    # line 2 is '{"prompt": "caf' + 0xe9: 15 bytes before it, so column 16
    with pytest.raises(DataError, match=rf"^{path}:2: not UTF-8 text \(byte 0xe9 at column 16\)"):
        load_rows(path)


def test_a_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b",\n{"prompt": "c"}\n')
    with pytest.raises(DataError, match=rf"^{path}:2: not valid JSON: Expecting property name"):
        load_rows(path)


def test_json_file_holds_a_list(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('[{"prompt": "a"},\n {"prompt": ""}]')
    with pytest.raises(DataError, match=rf"^{path} row 1: 'prompt' is empty"):
        load_rows(path)
    path.write_text('{"prompt": "a"}')
    with pytest.raises(DataError, match="must hold a list of rows, got dict"):
        load_rows(path)


@pytest.mark.parametrize("row, message", [
    ({"prompt": ""}, "'prompt' is empty ('')"),
    ({"prompt": " \n\t"}, "'prompt' is only whitespace"),
    ({"prompt": 7}, "'prompt' must be a string or a list of chat messages, got int"),
    ({"messages": "hi"}, "'messages' must be a non-empty list of {'role', 'content'} messages, got str"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": ["hi"]}, "messages[0] must be an object with 'role' and 'content', got str"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "messages[0].role='bot'; accepted: system, user, assistant, tool"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content must be a string, got list"),
    ({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "  "}]},
     "'messages' has no user message with text (roles: system, user)"),
    ({"prompt": [{"role": "user"}]}, "prompt[0].content must be a string, got NoneType"),
    ({"question": "hi"}, "the row needs a 'prompt' (or 'messages'); it has 'question'"),
    (3, "a row must be an object with 'prompt' or 'messages', got int"),
])
def test_bad_rows_are_named_by_index(row, message):
    with pytest.raises(DataError) as e:
        load_rows([{"prompt": "fine"}, row])
    assert str(e.value).startswith("row 1: ") and message in str(e.value), str(e.value)


def test_good_rows_pass_as_they_are():
    rows = [{"prompt": "hi", "answer": 1}, "plain string",
            {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "q"},
                          {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]},
                          {"role": "tool", "content": "4"}, {"role": "user", "content": "and?"}]}]
    out = load_rows(rows)
    assert out == [{"prompt": "hi", "answer": 1}, {"prompt": "plain string"}, rows[2]]
    assert [r.origin for r in out] == ["row 0", "row 1", "row 2"]


def test_many_bad_rows_list_the_first_five_and_count_the_rest():
    with pytest.raises(DataError) as e:
        load_rows([{"prompt": ""}] * 8, where="data/hf")
    lines = str(e.value).splitlines()
    assert lines[0] == "8 bad dataset rows:" and lines[-1] == "(and 3 more)"
    assert lines[1:6] == [f"data/hf row {i}: 'prompt' is empty ('')" for i in range(5)]


def test_empty_and_missing_datasets(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="the dataset '.*empty.jsonl' is empty"):
        load_rows(tmp_path / "empty.jsonl")
    with pytest.raises(ConfigError, match="does not exist"):
        load_rows(tmp_path / "nope.jsonl")


def test_reward_columns_are_the_keywords_without_defaults():
    def judge(*, completions, prompts, answer, rubric, style="short", **_):
        return [0.0] * len(completions)

    @ml.recipe
    def r(policy, prompts):
        done = ml.generate(policy, prompts, name="completions")
        rewards = ml.reward("exact_match", rollout=done) + ml.reward(judge, rollout=done, rubric="strict") \
            + ml.reward("length", rollout=done)
        ml.set_loss(ml.grpo_loss(ml.advantages(rewards, name="advantages"), ml.logprobs(policy, prompts, done)))

    step = ml.compile(r, policy=ml.Agent("tiny-random", trainable=True), group_size=2, max_new_tokens=4)
    try:
        # exact_match reads answer; judge reads answer (rubric is bound, style has a default); length none
        assert reward_columns(step.plan) == {"answer": ["exact_match", "judge"]}
        with pytest.raises(DataError) as e:
            prepare_rows(step, [{"prompt": "a", "answer": "1"}, {"prompt": "b"}, {"prompt": "c", "answer": None}])
        assert str(e.value).splitlines() == [
            "2 bad dataset rows:",
            "row 1: column 'answer', which reward 'exact_match', 'judge' reads, is missing; the row has: prompt",
            "row 2: column 'answer', which reward 'exact_match', 'judge' reads, is null; the row has: answer, prompt"]
    finally:
        step.close()


def test_the_limit_is_the_context_less_max_new_tokens(step):
    (site,) = prompt_sites(step)
    # tiny-random: max_position_embeddings 4096; compile max_new_tokens 8
    assert (site.node, site.agent, site.limit) == ("completions", "policy", 4096 - 8)
    (site,) = prompt_sites(step, max_prompt_tokens=100)
    assert site.limit == 100 and site.why == "max_prompt_tokens=100"


def test_an_over_long_prompt_is_an_error_naming_the_row(step):
    (site,) = prompt_sites(step)
    rows = load_rows([{"prompt": "short"}, {"prompt": "word " * 20_000}])  # 100,000 characters
    n = prompt_length(site, rows[1]["prompt"])
    assert n > 4088
    with pytest.raises(DataError) as e:
        fit_prompts(step, rows)
    assert str(e.value) == (f"row 1: the prompt is {n} tokens (with the chat template, as node 'completions' renders "
                            f"it), over the limit of 4088: the context of agent 'policy' (4096 positions, "
                            f"max_position_embeddings) less max_new_tokens=8; shorten it, or set truncation "
                            f"(data.truncation: left|right) to cut it")


@pytest.mark.parametrize("truncation", ["left", "right"])
def test_truncation_cuts_the_last_user_message_to_fit(step, truncation):
    text = " ".join(f"w{i}" for i in range(400))
    rows = load_rows([{"prompt": text, "answer": "x"},
                      {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": text}]}])
    (site,) = prompt_sites(step, max_prompt_tokens=60)
    out = fit_prompts(step, rows, max_prompt_tokens=60, truncation=truncation)
    cut, msgs = out[0]["prompt"], out[1]["messages"]
    assert out[0]["answer"] == "x" and [r.origin for r in out] == ["row 0", "row 1"]
    for prompt in (cut, msgs):
        assert 50 <= prompt_length(site, prompt) <= 60  # cut to the limit, within re-tokenizing slack
    assert msgs[0] == {"role": "system", "content": "sys"}  # only the last user message is cut
    kept = msgs[1]["content"]
    # left keeps the end of the text, right its start
    assert (text.endswith(cut) and text.endswith(kept)) if truncation == "left" else \
        (text.startswith(cut) and text.startswith(kept))
    assert rows[0]["prompt"] == text  # the loaded rows are not changed


def test_a_template_longer_than_the_limit_cannot_be_cut(step):
    rows = load_rows([{"messages": [{"role": "system", "content": "s " * 200}, {"role": "user", "content": "q"}]}])
    with pytest.raises(DataError, match="row 0: the prompt cannot be cut to 30 tokens"):
        fit_prompts(step, rows, max_prompt_tokens=30, truncation="left")
    with pytest.raises(ConfigError, match="truncation='middle'; accepted: error, left, right"):
        fit_prompts(step, rows, truncation="middle")


def test_train_refuses_bad_data_before_any_step(step, tmp_path):
    with pytest.raises(DataError, match="row 1: 'prompt' is only whitespace"):
        ml.train(step, [{"prompt": "a"}, {"prompt": "   "}], steps=1, batch_size=1, run_dir=tmp_path / "r",
                 progress=False, tensorboard=False)
    with pytest.raises(DataError, match="eval_dataset row 0: the prompt is"):
        ml.train(step, [{"prompt": "a"}], eval_dataset=[{"prompt": "x" * 5000}], steps=1, batch_size=1,
                 run_dir=tmp_path / "r", progress=False, tensorboard=False)
    assert step.step_count == 0 and not (tmp_path / "r" / "metrics.jsonl").exists()


def test_sampler_serves_the_checked_rows(tmp_path):
    rows = load_rows([{"prompt": str(i)} for i in range(3)])
    batch = Sampler(rows, batch_size=2, shuffle=False).next_batch()
    assert [r["prompt"] for r in batch] == ["0", "1"] and [r.origin for r in batch] == ["row 0", "row 1"]


def test_tool_schemas_the_template_adds_count_toward_the_limit():
    from materl.recipes.grpo_tools import grpo_tools_recipe

    # 300 tools, each with a long description: like an MCP server with hundreds of tools, the schema
    # block alone is far over the tiny model's 4,096 positions, whatever the question
    methods = {f"tool_{i:03d}": (lambda self, x: x) for i in range(300)}
    for i, fn in enumerate(methods.values()):
        fn.__doc__, fn.__annotations__ = f"Tool {i}: " + "does a thing with x. " * 8, {"x": str, "return": str}
    Many = type("Many", (), methods)
    toolbox = ml.mcp_tools(ml.PythonTools(Many))
    step = ml.compile(grpo_tools_recipe(toolbox), policy=ml.Agent("tiny-random", trainable=True), group_size=2,
                      max_new_tokens=8)
    try:
        with pytest.raises(DataError) as e:
            prepare_rows(step, [{"prompt": "What is 2 + 2?", "answer": "4"}])
        assert "with the chat template and 300 tool schemas, as node 'turn_1' renders it" in str(e.value)
        (site,) = prompt_sites(step)  # the toolbox was started to read its schemas
        assert len(site.tools) == 300 and prompt_length(site, "What is 2 + 2?") > 4088
        with pytest.raises(DataError, match="row 0: the prompt cannot be cut to 4088 tokens"):
            prepare_rows(step, [{"prompt": "What is 2 + 2?", "answer": "4"}], truncation="left")
    finally:
        step.close()


def test_a_datasets_folder_names_its_rows_by_index(tmp_path):
    datasets = pytest.importorskip("datasets")
    from materl.runtime.build import _data_from_config
    from materl.runtime.config import validate_config

    folder = tmp_path / "hf"
    datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}, {"prompt": "", "answer": "2"}]).save_to_disk(folder)
    with pytest.raises(DataError, match=rf"^{folder} row 1: 'prompt' is empty"):
        _data_from_config(validate_config({"data": {"source": str(folder), "test_size": 0}}))
