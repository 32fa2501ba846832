"""Which stack a Docker object belongs to: the ``conveyor.stack`` label.

Several Conveyor stacks can share one Docker daemon (two checkouts, a head project and a
worker-host project, test sessions). Every image, sandbox container and named volume Conveyor
creates carries ``conveyor.stack=<stack id>``.

Invariant: cleanup touches only its own stack. The sandbox janitor and image pruning select
what they remove by this label, so nothing another stack made (nor anything unlabelled, such
as a sandbox from a version of Conveyor before the label) is ever removed by them.

Where the id comes from, one place for every process: ``CONVEYOR_STACK_ID`` (``scripts/stack.sh``
sets it to ``<compose project>-<hash of the checkout path>``; the compose file hands it to every
service), else ``checkout-<hash of this checkout's path>``, so that two checkouts differ even
when nothing is set. It is a runtime variable (``shared.settings_sources.RUNTIME_VARIABLES``),
not a setting: sandbox labels are made far from the settings object, and a YAML value that the
janitor read but the labels did not would make a stack blind to its own sandboxes.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

LABEL_STACK = "conveyor.stack"
STACK_ID_ENV = "CONVEYOR_STACK_ID"
STACK_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"

CHECKOUT = Path(__file__).resolve().parents[1]


def checkout_stack_id(checkout: Path = CHECKOUT) -> str:
    """``checkout-<12 hex>``: the same for every process run from one checkout, different for two."""
    return "checkout-" + hashlib.sha256(str(checkout.resolve()).encode()).hexdigest()[:12]


def current_stack_id() -> str:
    """This process's stack id: ``CONVEYOR_STACK_ID``, else the checkout's."""
    stack_id = os.environ.get(STACK_ID_ENV) or checkout_stack_id()
    if not re.match(STACK_ID_PATTERN, stack_id):
        raise ValueError(f"{STACK_ID_ENV}={stack_id!r} is not a stack id (letters, digits, _.-, at most 63)")
    return stack_id


def stack_label(stack_id: str) -> str:
    """The ``label=`` filter value that selects one stack's objects."""
    return f"{LABEL_STACK}={stack_id}"
