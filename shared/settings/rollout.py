"""Settings of the rollout workers: group size, turn and token limits, sampling, sandboxes and the
agent proxy.

Part of ``shared.settings`` (its docstring states the invariants every section keeps).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from shared.settings.base import Float, Int, Section


class SamplingSettings(Section):
    temperature: Float = Field(1.0, ge=0)
    top_p: Float = Field(1.0, gt=0, le=1)


class AgentProxySettings(Section):
    """Bounds of the recording proxy (``services.rollout_worker.agents.proxy``) per trajectory's
    session, so that one sandbox cannot starve the worker's other trajectories."""
    # a body over this is refused with 413 before it is read (declared length), or as soon as
    # the bytes read pass it (chunked)
    max_body_bytes: Int = Field(8 * 1024 * 1024, gt=0)
    # bytes of request bodies a session holds at once, over all its connections (read, parsed or
    # waiting for its turn); a body that would pass it is refused with 429
    session_bytes_in_flight: Int = Field(16 * 1024 * 1024, gt=0)
    # connections open at once on a session's socket; one more is closed as soon as it is accepted
    session_connections: Int = Field(16, gt=0)
    # a connection that has not sent a whole request head this long after it opened (or after its
    # last answer) is closed: slow headers, and idle keep-alive connections
    header_timeout_s: Float = Field(15.0, gt=0)
    # the longest pause while a body is read; a body that stalls longer is dropped (408)
    idle_timeout_s: Float = Field(30.0, gt=0)
    # the text of a call's messages and tools, in characters: a longer one is refused (400)
    # before it is tokenized; tokenizing runs in a thread, off the event loop
    max_prompt_chars: Int = Field(1_000_000, gt=0)
    # the worker's cache of rendered initial prompts (chat_tokens.ChatTokens), in bytes of keys
    # and ids; a session's prompts leave it when the session closes
    prompt_cache_bytes: Int = Field(64 * 1024 * 1024, gt=0)


class RolloutSettings(Section):
    group_size: Int = Field(4, gt=0)
    # group redundancy: dispatch group_size + redundancy members, keep the first group_size
    # scored, cancel the rest (failed: superseded). Cuts the tail a slow sandbox adds to a group
    redundancy: Int = Field(0, ge=0)
    max_turns: Int = Field(4, gt=0)
    max_tokens_per_turn: Int = Field(32, gt=0)
    max_episode_tokens: Int = Field(256, gt=0)  # sampled tokens across all turns
    episode_timeout_s: Float = Field(600.0, gt=0)
    worker_concurrency: Int = Field(32, gt=0)  # Celery thread-pool slots per worker process
    # after a known infra error, a trajectory is queued again this long after attempt 1,
    # doubling per attempt up to retry_backoff_max_s (services.rollout_worker.runner)
    retry_backoff_s: Float = Field(2.0, ge=0)
    retry_backoff_max_s: Float = Field(30.0, ge=0)
    # on SIGTERM, running episodes get this long to finish; then they are handed back to the
    # queue (no attempt spent). Keep it below the orchestrator's kill timeout (compose: 10 s).
    shutdown_grace_s: Float = Field(5.0, ge=0)
    # a worker sends its scoring messages in batches (services.rollout_worker.scoring_outbox): a
    # batch goes out when its rollout task ends, at scoring_batch_max tasks, or this long after
    # its first task. Should a worker die first, the scoring reaper sends them from the ledger
    # ledger.lease_ttl_s + scoring_linger_s after their upload
    scoring_linger_s: Float = Field(0.25, ge=0)
    scoring_batch_max: Int = Field(64, gt=0)
    # a rollout task's finished trajectories are uploaded together, as one object
    # (services.rollout_worker.upload_outbox): when the task's episodes have all ended, at
    # upload_bundle_max trajectories, or this long after the first; until then each stays
    # running under its lease. upload_bundle_max 1 uploads each trajectory alone
    upload_linger_s: Float = Field(0.25, ge=0)
    upload_bundle_max: Int = Field(64, gt=0)
    sampling: SamplingSettings = SamplingSettings()
    # Agent-driven environments: each trajectory's proxy socket lives in a directory of its own
    # under this one (per worker process), which that trajectory's sandbox mounts. Keep it short:
    # a Unix socket path has at most 107 bytes. The Docker daemon must see it at the same path.
    agent_socket_dir: Path = Path("/tmp/conveyor-agents")
    agent_proxy: AgentProxySettings = AgentProxySettings()
