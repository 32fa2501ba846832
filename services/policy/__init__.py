"""The policy model, beneath both its users: the trainer (which trains it) and the weights plane
(which checks that a replica serves it). ``model`` loads the checkpoint vLLM serves and computes
token logprobs; ``probe`` is the logprob probe every checkpoint carries and every weight sync
checks.

Invariants:
- Nothing here imports the trainer, the weights plane or inference: arrows only come in
  (tests/unit/test_import_boundaries.py).
"""
