"""The coding environment (issue 3, item 5): a repository, a sandbox per trajectory, hidden tests.

- ``task``      dataset rows (SWE-bench, swe-agent-13k) -> task data; ``coding_task`` validates.
- ``config``    ``CodingConfig``, read from ``env_config``.
- ``repo``      the workspace: a host-side clone at ``base_commit``, as one fresh commit, cached.
- ``images``    image per language; the Python profile built offline (``images/python``).
- ``snapshot``  per-repo snapshot images (workspace + setup commands), tagged by content hash.
- ``tools``     tool-call checking and observations; ``prompts`` the system prompt.
- ``env``       ``CodingEnv``: reset/step/verify/close on the sandbox API.
- ``verifier``  the hidden tests in a fresh sandbox; ``grading`` its commands and scoring rule.
- ``artifacts`` diff, test output and command log to the object store.

Invariants (each module states its own):
- The hidden tests never enter the agent's sandbox; the reward depends only on the agent's diff,
  replayed in a fresh sandbox with test files and test configuration taken from the task.
- The agent's workspace holds no commit after ``base_commit``.
- Every sandbox carries the trajectory's labels and is torn down by ``close``.
"""

from .artifacts import artifact_keys, write_artifacts
from .config import CodingConfig
from .env import CodingEnv
from .task import CodingTask, coding_task

__all__ = ["CodingConfig", "CodingEnv", "CodingTask", "artifact_keys", "coding_task", "write_artifacts"]
