"""The recording proxy: an OpenAI-compatible chat endpoint between an agent and vLLM.

An agent that only knows an OpenAI base URL (Cline, mini-swe-agent, any script) talks to it;
the proxy renders the chat template itself, calls vLLM token-in/token-out (the worker's own, or
the trajectory's run's own server: each session calls the server it was opened with), and records
every sampled id with its logprob and policy version as the trajectory's turns (``recording``). The
HTTP side and the per-trajectory sessions are ``server``; what one session may take of the
worker (connections, body bytes) is ``bounds``.
"""

from services.rollout_worker.agents.proxy.recording import AgentRecording, BudgetExhausted, RecordingLimits
from services.rollout_worker.agents.proxy.server import AgentProxy, ProxySession

__all__ = ["AgentProxy", "AgentRecording", "BudgetExhausted", "ProxySession", "RecordingLimits"]
