"""Tool-call parsing, the built-in environments and the reward combiner."""

from __future__ import annotations

import asyncio
import math
import textwrap
import uuid

import pytest

from shared.environments import EnvironmentConfigError, EnvironmentRegistry, EnvironmentUnavailable
from shared.environments import AgentAction
from services.rollout_worker.environments.guess_number import GuessNumberEnv
from services.rollout_worker.environments.qa import QuestionAnswerEnv
from services.rollout_worker.tool_calls import parse_tool_calls
from shared.scoring.rewards import RewardCombiner, RewardError, resolve
from shared.schemas import RolloutRequest, StopReason, TaskProfile, ToolCall, Trajectory, Turn

# --- parse_tool_calls ---------------------------------------------------------------------


def call(payload: str) -> str:
    return f"<tool_call>{payload}</tool_call>"


def test_no_tool_call_is_not_an_error():
    assert parse_tool_calls("I think it is 5.") == ([], None)
    assert parse_tool_calls("") == ([], None)


def test_one_good_tool_call():
    calls, error = parse_tool_calls('Let me guess. ' + call('{"name": "guess", "arguments": {"number": 5}}') + " done")
    assert error is None
    assert calls == [ToolCall(name="guess", arguments={"number": 5})]


def test_multiple_tool_calls_in_order_and_across_lines():
    text = call('{"name": "guess", "arguments": {"number": 1}}') + "\n" + call('\n{"name": "look"}\n')
    calls, error = parse_tool_calls(text)
    assert error is None
    assert calls == [ToolCall(name="guess", arguments={"number": 1}), ToolCall(name="look", arguments={})]


def test_malformed_json_names_the_call_and_keeps_earlier_calls():
    calls, error = parse_tool_calls(call('{"name": "a"}') + call('{"name": "guess", "arguments": {number: 3}}'))
    assert calls == [ToolCall(name="a")]
    assert error.startswith("tool call 2 is not valid JSON")


@pytest.mark.parametrize("payload", ['{"arguments": {"number": 3}}', '{"name": 5}', '["guess"]', '"guess"'])
def test_missing_or_non_string_name(payload):
    calls, error = parse_tool_calls(call(payload))
    assert calls == []
    assert error == 'tool call 1 needs an object with a string "name"'


def test_arguments_must_be_an_object():
    calls, error = parse_tool_calls(call('{"name": "guess", "arguments": [3]}'))
    assert calls == [] and error == 'tool call 1: "arguments" must be an object'


def test_unclosed_tool_call():
    calls, error = parse_tool_calls('<tool_call>{"name": "guess", "arguments": {"number": 3}}')
    assert calls == []
    assert error is not None and "never closed" in error and error.startswith("1 tool call(s)")
    calls, error = parse_tool_calls(call('{"name": "a"}') + '<tool_call>{"name": "b"')
    assert calls == [ToolCall(name="a")] and "never closed" in error


# found by the fuzz (tests/unit/test_tool_calls_fuzz.py)
@pytest.mark.parametrize("body, error", [
    ("[" * 5000 + "]" * 5000, "tool call 1 cannot be read: nested too deeply"),  # was RecursionError
    ('{"name": "guess", "arguments": {"number": ' + "9" * 5000 + "}}", "tool call 1 cannot be read: Exceeds the limit"),  # was ValueError
])
def test_json_python_will_not_read_is_a_malformed_call(body, error):
    calls, message = parse_tool_calls(call(body))
    assert calls == [] and message.startswith(error)


def test_an_argument_holding_the_opening_tag_is_not_an_unclosed_call():
    calls, error = parse_tool_calls(call('{"name": "bash", "arguments": {"cmd": "grep -n <tool_call> out.txt"}}'))
    assert calls == [ToolCall(name="bash", arguments={"cmd": "grep -n <tool_call> out.txt"})] and error is None


@pytest.mark.parametrize("text", ["<tool_call>", "</tool_call><tool_call>{", "<tool_call><tool_call>{}</tool_call>", "\x00" * 3 + "<tool_call>}{"])
def test_parsing_never_raises(text):
    calls, error = parse_tool_calls(text)
    assert isinstance(calls, list)
    assert error is None or isinstance(error, str)


# --- environments -------------------------------------------------------------------------


def action(text: str) -> AgentAction:
    calls, error = parse_tool_calls(text)
    return AgentAction(text=text, tool_calls=calls, tool_call_error=error)


def guess(n) -> AgentAction:
    return action(call(f'{{"name": "guess", "arguments": {{"number": {n}}}}}'))


def test_registry():
    registry = EnvironmentRegistry(entry_points=False)
    assert registry.resolve("guess_number") is GuessNumberEnv and registry.resolve("qa") is QuestionAnswerEnv
    env = registry.make("guess_number", {"max_turns": 3})
    assert isinstance(env, GuessNumberEnv) and env.env_config == {"max_turns": 3} and env.config.max_turns == 3
    with pytest.raises(EnvironmentUnavailable, match="unknown environment 'chess'; registered: .*guess_number"):
        registry.make("chess", {})
    with pytest.raises(EnvironmentConfigError, match=r"'guess_number'.*env_config.max_turnz: Extra inputs"):
        registry.make("guess_number", {"max_turnz": 3})


def test_guess_number_higher_lower_correct():
    async def play():
        env = GuessNumberEnv()
        messages = await env.reset({"low": 1, "high": 100, "target": 42}, seed=0)
        assert [m["role"] for m in messages] == ["system", "user"]
        assert "between 1 and 100" in messages[1]["content"]
        assert '"name": "guess"' in messages[0]["content"]
        low = await env.step(guess(10))
        high = await env.step(guess(90))
        hit = await env.step(guess(42))
        verdict = await env.verify()
        return low, high, hit, verdict

    low, high, hit, verdict = asyncio.run(play())
    assert (low.observation, low.done) == ("higher", False)
    assert (high.observation, high.done) == ("lower", False)
    assert (hit.observation, hit.done, hit.reward) == ("correct", True, 1.0)
    assert verdict.reward == 1.0 and verdict.info == {"solved": True, "guesses": 3}


@pytest.mark.parametrize(
    "act, needle",
    [
        (action('<tool_call>{"name": "guess", "arguments": {number: 3}}</tool_call>'), "not valid JSON"),
        (action('<tool_call>{"name": "guess"'), "never closed"),
        (action("I guess 5"), "no guess"),
        (action(call('{"name": "look", "arguments": {}}')), "no guess"),
        (guess('"five"'), '"number" must be an integer'),
        (guess(5.5), '"number" must be an integer'),
        (guess("true"), '"number" must be an integer'),
    ],
)
def test_guess_number_bad_output_is_an_error_observation(act, needle):
    async def play():
        env = GuessNumberEnv()
        await env.reset({"low": 1, "high": 10, "target": 5}, seed=0)
        result = await env.step(act)
        return result, await env.verify()

    result, verdict = asyncio.run(play())
    assert result.observation.startswith("Error")
    assert needle in result.observation
    assert result.done is False and result.info == {"invalid": True}
    assert verdict.reward == 0.0  # an invalid guess is not a guess


def test_guess_number_partial_reward_rewards_closeness():
    async def verify_after(*numbers):
        env = GuessNumberEnv()
        await env.reset({"low": 0, "high": 100, "target": 50}, seed=0)
        for n in numbers:
            await env.step(guess(n))
        return (await env.verify())

    assert asyncio.run(verify_after()).reward == 0.0
    assert asyncio.run(verify_after(0)).reward == pytest.approx(0.5 * (1 - 50 / 100))
    assert asyncio.run(verify_after(40)).reward == pytest.approx(0.5 * (1 - 10 / 100))
    # the best guess counts, not the last one
    best_then_worse = asyncio.run(verify_after(49, 0))
    assert best_then_worse.reward == pytest.approx(0.5 * 0.99)
    assert best_then_worse.info == {"solved": False, "guesses": 2}
    assert asyncio.run(verify_after(0)).reward < asyncio.run(verify_after(40)).reward < 0.5 < asyncio.run(verify_after(50)).reward
    # far outside the range: clamped at 0, never negative
    assert asyncio.run(verify_after(10_000)).reward == 0.0


def test_guess_number_single_value_range():
    async def play():
        env = GuessNumberEnv()
        await env.reset({"low": 3, "high": 3, "target": 3}, seed=0)
        await env.step(guess(4))
        return await env.verify()

    assert asyncio.run(play()).reward == 0.0  # span is clamped to 1: no division by zero


@pytest.mark.parametrize(
    "reply, reward",
    [("The answer is Paris.", 1.0), ("  PARIS  ", 1.0), ("paris\n", 1.0), ("Lyon", 0.0), ("", 0.0)],
)
def test_question_answer_env(reply, reward):
    async def play():
        env = QuestionAnswerEnv()
        messages = await env.reset({"question": "Capital of France?", "answer": "Paris"}, seed=1)
        step = await env.step(AgentAction(text=reply, tool_calls=[], tool_call_error=None))
        return messages, step, await env.verify()

    messages, step, verdict = asyncio.run(play())
    assert messages == [{"role": "user", "content": "Capital of France?"}]
    assert step.done is True
    assert verdict.reward == reward and verdict.info == {"correct": reward == 1.0}


def test_question_answer_env_normalizes_whitespace_in_the_answer():
    async def play():
        env = QuestionAnswerEnv()
        await env.reset({"question": "q", "answer": "New   York"}, seed=0)
        await env.step(AgentAction(text="it is new\nyork", tool_calls=[], tool_call_error=None))
        return await env.verify()

    assert asyncio.run(play()).reward == 1.0


# --- rewards ------------------------------------------------------------------------------


def trajectory(env_reward=None, turns=None, env_config=None) -> Trajectory:
    task = TaskProfile(task_id="t", env_name="guess_number", task_data={}, env_config=env_config or {})
    req = RolloutRequest(run_id="r", group_id=0, episode_index=0, episode_seed=0, trajectory_id="r_0_0_0",
                         group_size=1, task=task, dispatched_at=0.0)
    return Trajectory(request=req, turns=turns or [], stop_reason=StopReason.done, env_reward=env_reward)


def turn(index: int, sampled: int, tool_calls=(), error=None) -> Turn:
    return Turn(index=index, prompt_token_ids=[1], sampled_token_ids=[2] * sampled, logprobs=[-0.1] * sampled,
                policy_version=0, finish_reason="stop", completion_text="", tool_calls=list(tool_calls), tool_call_error=error)


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    name = "conveyor_test_rewards_" + uuid.uuid4().hex[:8]
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        def constant(trajectory):
            return 0.25

        def boom(trajectory):
            raise ZeroDivisionError("division by zero in my reward")

        def nan(trajectory):
            return float("nan")

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_combiner_weights_builtin_rewards():
    good = ToolCall(name="guess", arguments={"number": 1})
    traj = trajectory(
        env_reward=0.5,
        turns=[turn(0, 4, [good]), turn(1, 2, [good], error="tool call 2 is not valid JSON"), turn(2, 2), turn(3, 2, [good])],
        env_config={"max_episode_tokens": 20},
    )
    total, parts = RewardCombiner({"verifier": 1.0, "format": 0.1, "brevity": 2.0}).score(traj)
    values = {p.name: (p.value, p.weight) for p in parts}
    assert values == {"verifier": (0.5, 1.0), "format": (0.5, 0.1), "brevity": (pytest.approx(0.5), 2.0)}
    assert total == pytest.approx(0.5 * 1.0 + 0.5 * 0.1 + 0.5 * 2.0)


def test_verifier_without_env_reward_is_zero_and_format_without_turns_is_zero():
    total, parts = RewardCombiner({"verifier": 1.0, "format": 1.0}).score(trajectory())
    assert total == 0.0 and [p.value for p in parts] == [0.0, 0.0]


def test_import_path_reward_function(reward_module):
    assert resolve(f"{reward_module}:constant")(trajectory()) == 0.25
    total, parts = RewardCombiner({f"{reward_module}:constant": 4.0, "verifier": 1.0}).score(trajectory(env_reward=1.0))
    assert total == pytest.approx(2.0)
    assert parts[0].name == f"{reward_module}:constant" and parts[0].value == 0.25


def test_raising_reward_function_is_an_error_naming_it(reward_module):
    combiner = RewardCombiner({"verifier": 1.0, f"{reward_module}:boom": 1.0})
    with pytest.raises(RewardError) as info:
        combiner.score(trajectory(env_reward=1.0))
    message = str(info.value)
    assert f"{reward_module}:boom" in message and "ZeroDivisionError" in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_non_finite_reward_is_an_error_naming_the_function(reward_module):
    with pytest.raises(RewardError, match=f"{reward_module}:nan.*nan"):
        RewardCombiner({f"{reward_module}:nan": 1.0}).score(trajectory())


@pytest.mark.parametrize(
    "name, needle",
    [
        ("no_such_builtin", "not a built-in"),
        ("no_such_module_xyz:fn", "cannot be imported"),
        ("math:no_such_function", "cannot be imported"),
    ],
)
def test_bad_reward_names_fail_at_construction(name, needle):
    with pytest.raises(RewardError, match=needle) as info:
        RewardCombiner({name: 1.0})
    assert name in str(info.value)


def test_non_callable_and_empty_reward_configs(reward_module):
    with pytest.raises(RewardError, match="not callable"):
        RewardCombiner({f"{reward_module}:NOT_CALLABLE": 1.0})
    with pytest.raises(RewardError, match="no reward functions"):
        RewardCombiner({})
    assert math.isclose(resolve("math:sqrt")(4), 2.0)


def test_single_turn_env_scores_with_the_users_reward_function():
    import asyncio

    from services.rollout_worker.environments.single_turn import SingleTurnEnv
    from services.rollout_worker.environments.toy_rewards import digit_share

    env = SingleTurnEnv({"reward_fn": "services.rollout_worker.environments.toy_rewards:digit_share"})
    messages = asyncio.run(env.reset({"prompt": "Count!", "row": {"id": 1}}, seed=0))
    assert messages == [{"role": "user", "content": "Count!"}]
    asyncio.run(env.step(AgentAction("12 ab", [], None)))
    assert asyncio.run(env.verify()).reward == pytest.approx(0.5) == digit_share("12 ab", {})


def test_single_turn_env_rejects_a_bad_reward_path():
    import asyncio

    from services.rollout_worker.environments.single_turn import SingleTurnEnv

    with pytest.raises(ValueError, match="module:function|package.module:function"):
        asyncio.run(SingleTurnEnv({"reward_fn": "no_colon_here"}).reset({"prompt": "p"}, seed=0))


def test_observation_frame_gives_the_same_ids_as_rendering_each_turn(tmp_path):
    from transformers import AutoTokenizer

    from services.inference.tiny_model import generate_tiny_model
    from services.rollout_worker.chat_tokens import ChatTokens

    tokenizer = AutoTokenizer.from_pretrained(str(generate_tiny_model(tmp_path / "m")))
    framed, rendered = ChatTokens(tokenizer), ChatTokens(tokenizer)
    rendered._frames = {"user": ()}  # no frame: the template renders every observation
    for observation in ("lower", "Error: tool call 1 is not valid JSON", "  spaced \n text "):
        for eos in (True, False):
            assert framed.observation_ids(observation, eos) == rendered.observation_ids(observation, eos)
    assert framed._frames["user"]  # ChatML keeps the observation verbatim, so the frame is used


def test_initial_prompt_kept_gives_the_rendered_ids_each_to_its_own(tmp_path, monkeypatch):
    """A group's members start from the same prompt: rendered once, the same ids as rendering
    it; each caller gets its own list, and a change of messages or key order renders anew."""
    from transformers import AutoTokenizer

    from services.inference.tiny_model import generate_tiny_model
    from services.rollout_worker.chat_tokens import ChatTokens

    tokenizer = AutoTokenizer.from_pretrained(str(generate_tiny_model(tmp_path / "m")))
    chat = ChatTokens(tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say a number."}]
    rendered = chat._render_prompt(messages, None)
    renders = []
    monkeypatch.setattr(chat, "_render_prompt", lambda m, t: renders.append(m) or rendered.copy())
    first, second = chat.initial_prompt(messages), chat.initial_prompt(messages)
    assert first == second == rendered and first is not second
    first.append(0)
    assert chat.initial_prompt(messages) == rendered  # a caller's list is its own
    assert len(renders) == 1
    chat.initial_prompt([{"content": "Say a number.", "role": "user"}])  # the key order counts
    chat.initial_prompt([{"role": "user", "content": "Say another."}])
    assert len(renders) == 3
    third = '[[{"role": "user", "content": "Say a third."}], null]'
    chat.cache_bytes = len(third) + 8 * len(rendered)  # room for one entry (every render here has the same ids)
    keys: set[str] = set()
    chat.initial_prompt([{"role": "user", "content": "Say a third."}], keys=keys)
    assert list(chat._prompts) == [third] and chat.cached_bytes == chat.cache_bytes  # the older ones went
    chat.cache_bytes = 10  # a prompt bigger than the whole cache is not kept
    chat.initial_prompt([{"role": "user", "content": "Say a fourth."}])
    assert list(chat._prompts) == [third]
    chat.forget(keys)
    assert chat._prompts == {} and chat.cached_bytes == 0
