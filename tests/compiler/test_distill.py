"""On-policy distillation end to end (recipes/distill.py, ml.with_distillation): a tiny random
student and a different tiny random teacher (another seed), real engines and learner. The
teacher's log-probs of each episode's exact ids are recomputed here by a plain HF forward, and
the advantages checked against ``-(sampling log-prob - teacher log-prob)`` token by token."""

import pytest
import torch

import materl as ml
from materl.engines.tiny import build_tiny_random, byte_tokenizer
from materl.errors import CompileError, RecipeError
from materl.recipes import distill, grpo
from tests.distributed.tool_recipe import calculator_recipe


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("teacher")
    build_tiny_random(folder, seed=1)  # same architecture and tokenizer, other weights
    return folder


def hf_logprobs(agent, prompt_ids, completion_ids) -> torch.Tensor:
    """log p(completion_ids | prompt) under ``agent``'s model, by a plain forward (float64 softmax)."""
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logits = agent.model(ids).logits[0, len(prompt_ids) - 1:-1].double()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1)


def compile_distill(recipe, teacher, **kw):
    agents = {"policy": kw.pop("policy", None) or ml.Agent("tiny-random", trainable=True), "teacher": teacher}
    options = dict(group_size=2, max_new_tokens=6, lr=1e-3, seed=0, temperature=1.0) | kw
    return ml.compile(recipe, **agents, **options)


def check_advantages(ep, teacher, *, coef=1.0, base=None, rollout="completions", node="advantages"):
    r = ep.values[rollout]
    mask = torch.tensor(r.loss_mask, dtype=torch.float64)
    gap = torch.tensor(r.sampling_logprobs, dtype=torch.float64) - hf_logprobs(teacher, r.prompt_ids, r.completion_ids)
    expected = (-coef * gap * mask + (base if base is not None else 0.0)) * mask
    got = ep.resolve(node).double()[:len(mask)]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * max(1.0, float(expected.abs().max())))
    torch.testing.assert_close(ep.resolve(f"{node}.reverse_kl").double()[:len(mask)], gap * mask, rtol=0, atol=1e-4)
    return gap, mask


def test_the_advantage_is_minus_the_student_teacher_gap_on_the_sampled_ids(teacher_dir):
    teacher = ml.Agent(str(teacher_dir))
    step = compile_distill(distill, teacher)
    try:
        metrics = step.run(["ab", "cd"])
        per_episode = []
        for ep in step.last_episodes:
            gap, mask = check_advantages(ep, teacher)
            per_episode.append(float((gap * mask).sum() / mask.sum()))
    finally:
        step.close()
    # the reported reverse KL: each episode's mean per trained token, averaged over the episodes
    assert metrics["advantages/reverse_kl"] == pytest.approx(sum(per_episode) / len(per_episode), abs=1e-5)
    assert metrics["advantages/reverse_kl"] != 0  # two different models disagree
    assert "reward" not in metrics  # pure distillation: no reward


def test_print_and_the_teacher_is_never_moved_toward_the_student(teacher_dir):
    assert str(distill).splitlines()[4:6] == [
        "  %teacher_logprobs = logprobs(@teacher, %prompts, %completions) [batch]",
        "  %advantages = distill_advantages(%completions, %policy_logprobs, %teacher_logprobs) "
        "{coef=1, discount=0} [batch]",
    ]
    teacher = ml.Agent(str(teacher_dir))
    before = [p.detach().clone() for p in teacher.model.parameters()]
    step = compile_distill(distill, teacher, reference="ema", reference_options={"decay": 0.5})
    try:
        assert step.references == []  # the teacher is no reference that follows the policy
        step.run(["ab"])
    finally:
        step.close()
    assert all(torch.equal(a, b) for a, b in zip(before, teacher.model.parameters()))


def test_distillation_moves_the_student_toward_the_teacher(teacher_dir):
    """A teacher taught to answer "hi" with "ab" (tests/rollout/taught.py); the student samples one
    token per episode, 256 episodes a step, so the sampled reverse-KL gradient has little noise
    (over a 512-token vocabulary, 64 samples give a direction mostly noise, measured). After 8
    steps the student's exact KL to the teacher at that token is lower, and "a" more likely."""
    from materl.rollout.multiturn import EpisodeState
    from tests.rollout.taught import teach

    teacher, student = ml.Agent(str(teacher_dir)), ml.Agent("tiny-random", trainable=True)
    ctx = EpisodeState.start(teacher.tokenizer, [{"role": "user", "content": "hi"}]).ids
    for _ in range(3):  # each call trains on until greedy decoding gives "ab": three make the teacher sharper
        teach(teacher, [(ctx, "ab")])

    def first_token() -> tuple[float, float]:  # exact KL(student || teacher) there, and log p_student("a")
        with torch.no_grad():
            p = student.model(torch.tensor([ctx])).logits[0, -1].double().log_softmax(-1)
            q = teacher.model(torch.tensor([ctx])).logits[0, -1].double().log_softmax(-1)
        return float((p.exp() * (p - q)).sum()), float(p[ord("a")])

    kl_before, a_before = first_token()
    step = compile_distill(distill, teacher, policy=student, lr=2e-3, max_new_tokens=1, group_size=256)
    try:
        for _ in range(8):
            step.run(["hi"])
    finally:
        step.close()
    kl_after, a_after = first_token()
    assert kl_after < kl_before - 0.005 and a_after > a_before + 0.3, (kl_before, kl_after, a_before, a_after)


def test_a_teacher_with_another_tokenizer_is_a_compile_error():
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_tokenizer(600)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    other = ml.Agent(model, tokenizer=tok, name="vocab600")
    with pytest.raises(CompileError, match=r"tokenizer mismatch between student 'policy' \(tiny-random\) and teacher "
                                           r"'teacher' \(vocab600\): student vocabulary has 512 tokens, teacher's 600"):
        compile_distill(distill, other)
    with pytest.raises(CompileError, match="the teacher agent 'teacher' is trainable"):
        compile_distill(distill, ml.Agent("tiny-random", trainable=True))
    with pytest.raises(RecipeError, match=r"discount must be a number in \[0, 1\], got 2"):
        ml.with_distillation(grpo, "teacher", 1.0, discount=2)
    with pytest.raises(RecipeError, match="already has a parameter 'ref_policy'"):
        ml.with_distillation(grpo, "ref_policy", 1.0)


def test_with_distillation_adds_the_teacher_term_to_grpo_advantages(teacher_dir):
    distilled = ml.with_distillation(grpo, "teacher", 0.5)
    assert distilled.params == ("policy", "ref_policy", "prompts", "teacher")
    lines = str(distilled).splitlines()
    assert "  %advantages_prev = advantages(%rewards, %completions) [group]" in lines
    assert ("  %advantages = distill_advantages(%completions, %policy_logprobs, %teacher_logprobs, %advantages_prev) "
            "{coef=0.5, discount=0} [batch]") in lines
    teacher = ml.Agent(str(teacher_dir))
    step = compile_distill(distilled, teacher, ref_policy=ml.Agent("tiny-random"))
    try:
        metrics = step.run(["ab", "cd"])
        for ep in step.last_episodes:
            check_advantages(ep, teacher, coef=0.5, base=ep.resolve("advantages_prev").double())
    finally:
        step.close()
    assert "reward" in metrics and "advantages/reverse_kl" in metrics


def test_multi_turn_with_tools_scores_only_the_sampled_tokens(teacher_dir):
    toolbox = ml.mcp_tools("python -m materl.tools.calculator")
    distilled = ml.with_distillation(calculator_recipe(toolbox), "teacher", 1.0, discount=0.9)
    teacher = ml.Agent(str(teacher_dir))
    step = compile_distill(distilled, teacher, max_new_tokens=4)
    try:
        step.run(["what is 6*7?"])
        for ep in step.last_episodes:
            r = ep.values["rollout"]
            mask = torch.tensor(r.loss_mask, dtype=torch.float64)
            assert 0 < mask.sum() < len(mask)  # the calculator's answer sits inside the row, untrained
            gap = torch.tensor(r.sampling_logprobs, dtype=torch.float64) - hf_logprobs(teacher, r.prompt_ids,
                                                                                        r.completion_ids)
            a = -gap * mask
            expected = torch.zeros_like(a)
            acc = 0.0
            for t in range(len(a) - 1, -1, -1):  # discounted over every position, tool tokens included
                acc = float(a[t]) + 0.9 * acc
                expected[t] = acc
            expected = (expected + ep.resolve("advantages_prev").double()[:len(mask)]) * mask
            got = ep.resolve("advantages").double()[:len(mask)]
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * max(1.0, float(expected.abs().max())))
            assert float(ep.resolve("advantages.reverse_kl")[:len(mask)][mask == 0].abs().sum()) == 0
    finally:
        step.close()


def test_lora_student_and_async_pipeline(teacher_dir, tmp_path):
    from materl.runtime.tasks import arithmetic_rows

    teacher = ml.Agent(str(teacher_dir))
    student = ml.Agent("tiny-random", trainable=True, lora=dict(r=4))
    step = compile_distill(distill, teacher, policy=student, max_staleness=1)
    try:
        out = ml.train(step, arithmetic_rows(8, seed=1), steps=3, batch_size=2, run_dir=tmp_path / "run",
                       progress=False, tensorboard=False)
    finally:
        step.close()
    history = out["history"]
    assert len(history) == 3 and all("advantages/reverse_kl" in h for h in history)
    assert max(h["async/staleness_max"] for h in history) <= 1
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)


@pytest.mark.slow
def test_smollm2_student_and_teacher():
    """The real SmolLM2-135M as student (through its default engine) and as teacher: the teacher's
    log-probs of the sampled ids are the same model's, so the advantages are the engine-vs-learner
    gap only (small), and they equal an HF forward's; a tiny-vocabulary teacher is refused."""
    student, teacher = ml.Agent("smollm2-135m-instruct", trainable=True), ml.Agent("smollm2-135m-instruct")
    step = compile_distill(distill, teacher, policy=student, max_new_tokens=8, group_size=2)
    try:
        metrics = step.run(["What is 2 + 3?"])
        for ep in step.last_episodes:
            check_advantages(ep, teacher)
    finally:
        step.close()
    assert abs(metrics["advantages/reverse_kl"]) < 0.02
    with pytest.raises(CompileError, match="student vocabulary has 49152 tokens, teacher's 512"):
        compile_distill(distill, ml.Agent("tiny-random"), policy=student)
