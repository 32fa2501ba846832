"""The policy's tokenizer as ``AutoTokenizer.from_pretrained`` builds it, in a process that never
imports torch.

A rollout worker only tokenizes. In transformers 5, importing ``AutoTokenizer`` (or ``AutoConfig``)
imports torch through the generation utilities: about 360 MB of resident memory per worker
process that nothing in it uses. The tokenizer classes themselves do not import torch. So
``AutoTokenizer``'s choice of class runs once, in a short-lived subprocess that names the class it
built. This process then imports that class alone and calls its ``from_pretrained`` on the same
directory, as ``AutoTokenizer`` does once it has chosen.

Invariants:
- The tokenizer is an instance of the class ``AutoTokenizer`` returns for the path, built by that
  class's ``from_pretrained``.
- Where the subprocess fails (a bad path, a broken tokenizer), or the class is not transformers'
  own (remote code), ``AutoTokenizer`` loads it in this process, as before: the same tokenizer,
  or the same error.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

from transformers import PreTrainedTokenizerBase

_NAME_THE_CLASS = ("import sys\nfrom transformers import AutoTokenizer\n"
                   "cls = type(AutoTokenizer.from_pretrained(sys.argv[1]))\nprint(cls.__module__, cls.__qualname__)")


def load_tokenizer(model_path: str | Path) -> PreTrainedTokenizerBase:
    path = str(model_path)
    named = subprocess.run([sys.executable, "-c", _NAME_THE_CLASS, path], capture_output=True, text=True)
    lines = named.stdout.strip().splitlines()
    if named.returncode == 0 and lines and lines[-1].startswith("transformers."):
        module_name, class_name = lines[-1].split()
        return getattr(importlib.import_module(module_name), class_name).from_pretrained(path)
    from transformers import AutoTokenizer  # imports torch

    return AutoTokenizer.from_pretrained(path)
