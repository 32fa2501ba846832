"""Environments that need the main thread run there without the user saying so (issue 24: a
verifiers environment failed every episode with "signal only works in main thread").

Real components: the environments below call ``signal.signal`` themselves (as verifiers'
timeouts do), their calls run on the worker's own event-loop thread (``background_loop``), and
the host processes are real interpreters."""

from __future__ import annotations


import pytest

from services.rollout_worker.environments.main_thread import on_main_thread
from services.rollout_worker.event_loop import background_loop
from shared.environments import AgentAction, EnvironmentRegistry

GAMES = '''
import os
import signal
import threading

from services.rollout_worker.environments.hosted import HostedEnv
from shared.environments import Environment, StepResult, VerifyResult


def _on_alarm(signum, frame):
    raise TimeoutError("too slow")


def where():
    return f"pid {os.getpid()}, main thread {threading.current_thread() is threading.main_thread()}"


class AlarmAtReset(Environment):
    name = "alarm_at_reset"

    async def reset(self, task_data, seed):
        signal.signal(signal.SIGALRM, _on_alarm)
        self.moves = []
        return [{"role": "user", "content": f"game {seed} of {task_data['who']}; {where()}"}]

    async def step(self, action):
        self.moves.append(action.text)
        return StepResult(f"moves {self.moves}", done=len(self.moves) == 2)

    async def verify(self):
        return VerifyResult(float(len(self.moves)), {"moves": list(self.moves), "where": where()})


class AlarmAtVerify(AlarmAtReset):
    name = "alarm_at_verify"

    async def reset(self, task_data, seed):
        self.moves = []
        return [{"role": "user", "content": f"game {seed}; {where()}"}]

    async def verify(self):
        signal.signal(signal.SIGALRM, _on_alarm)
        return await super().verify()


class AlarmDriver:
    def reset(self, task_data, seed):
        signal.signal(signal.SIGALRM, _on_alarm)
        return [{"role": "user", "content": where()}]

    def step(self, action):
        return action, 0.0, True, {}

    def verify(self):
        return 1.0, {"where": where()}

    def close(self):
        pass


class AlarmHosted(HostedEnv):
    name = "alarm_hosted"
    driver_path = "alarm_games:AlarmDriver"
'''


@pytest.fixture
def registry(tmp_path, monkeypatch):
    (tmp_path / "alarm_games.py").write_text(GAMES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return EnvironmentRegistry({name: f"alarm_games:{cls}" for name, cls in
                                [("alarm_at_reset", "AlarmAtReset"), ("alarm_at_verify", "AlarmAtVerify"),
                                 ("alarm_hosted", "AlarmHosted")]}, entry_points=False)


def play(env, moves):
    """One episode on the worker's event-loop thread, as the rollout worker runs it."""
    async def episode():
        try:
            messages = await env.reset({"who": "me"}, 7)
            results = [await env.step(AgentAction(move, [], None)) for move in moves]
            return messages, results, await env.verify()
        finally:
            await env.close()
    return background_loop().run(episode())


def test_an_environment_that_sets_a_signal_handler_fails_off_the_main_thread(registry):
    """The defect itself: the worker's thread cannot set a handler."""
    with pytest.raises(ValueError, match="signal only works in main thread"):
        play(registry.make("alarm_at_reset", {}), [])


def test_a_signal_at_reset_moves_the_episode_to_a_host_main_thread_and_later_episodes_start_there(registry):
    env = on_main_thread(registry.make("alarm_at_reset", {}))
    messages, results, verdict = play(env, ["a", "b"])
    assert messages == [{"role": "user", "content": messages[0]["content"]}]
    assert messages[0]["content"].startswith("game 7 of me;") and messages[0]["content"].endswith("main thread True")
    assert [r.observation for r in results] == ["moves ['a']", "moves ['a', 'b']"] and results[-1].done
    assert verdict.reward == 2.0 and verdict.info["where"].endswith("main thread True")
    later = on_main_thread(registry.make("alarm_at_reset", {}))
    assert later.moved and play(later, ["c"])[2].info["moves"] == ["c"]


def test_a_signal_late_in_the_episode_moves_it_with_its_moves_so_far(registry):
    env = on_main_thread(registry.make("alarm_at_verify", {}))
    messages, results, verdict = play(env, ["a", "b"])
    assert messages[0]["content"].endswith("main thread False")  # started in place
    assert verdict.reward == 2.0 and verdict.info["moves"] == ["a", "b"]  # replayed on the host
    assert verdict.info["where"].endswith("main thread True")


def test_a_hosted_driver_on_a_thread_moves_to_a_host_process(registry):
    env = on_main_thread(registry.make("alarm_hosted", {"isolation": "thread"}))
    messages, _, verdict = play(env, ["x"])
    assert messages[0]["content"].endswith("main thread True") and verdict.info["where"].endswith("main thread True")
