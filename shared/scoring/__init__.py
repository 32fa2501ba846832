"""Scoring, shared by the two services that score: the scorer (``services.scorer``) and the
rollout worker when every reward function may run there (``services.rollout_worker.worker_scoring``).
``rewards``: the reward functions and their combination; ``scorer``: scoring under a lease."""
