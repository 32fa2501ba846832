"""Where settings come from, each source refusing what it cannot use, and which ``CONVEYOR_*``
environment variables exist, so a misspelt one is refused, not ignored.

A variable is known when it names a setting (``CONVEYOR_ROLLOUT__GROUP_SIZE``, a whole section
as JSON such as ``CONVEYOR_ROLLOUT``, a field of any variant of a discriminated setting such as
``CONVEYOR_INFERENCE__WEIGHT_SYNC__HOST``, an older flat name a section folds such as
``CONVEYOR_INFERENCE__WEIGHT_SYNC_HOST``, or an entry of a dict setting such as
``CONVEYOR_REWARDS__WEIGHTS__VERIFIER``), or when it is on one of the two allow-lists below.

Invariants:
- ``env_problem`` is None for every known name and, for any other name with the prefix, one
  line naming the variable and the closest known name; ``json_problem`` is None unless the
  variable sets a JSON-valued setting (a section, dict, list or tuple) and its value is not
  JSON. Neither raises.
- Each source raises ``SettingsError`` naming the variable, or the file and line, before
  pydantic-settings sees a value it would fail on with a traceback or silently drop.
  Among them: a setting with modes given its mode alone (``CONVEYOR_STORAGE=local``, not
  JSON) together with a field beneath it, which pydantic-settings would drop one of.
"""

from __future__ import annotations

import difflib
import io
import json
import os
import types
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import yaml
from dotenv.parser import parse_stream
from pydantic import BaseModel
from pydantic_settings import BaseSettings, DotEnvSettingsSource, EnvSettingsSource, YamlConfigSettingsSource


class SettingsError(ValueError):
    """A bad setting, with the field's dotted name (or the variable, or the file) in the message."""


PREFIX = "CONVEYOR_"
DELIMITER = "__"

# Read straight from os.environ by Conveyor's own code; they are not settings.
RUNTIME_VARIABLES = {
    "CONVEYOR_CONFIG": "the YAML settings file (shared/settings/)",
    "CONVEYOR_LOG_LEVEL": "the log level of a service's own log lines (services/cli/command_support.py)",
    "CONVEYOR_CA_BUNDLE": "the CA bundle the stack images trust (services/cli/stack_images.py)",
    "CONVEYOR_WHEEL_PORT": "the wheel server's port while images build (services/cli/image_wheels.py)",
    "CONVEYOR_STACK_ID": "the stack id in the conveyor.stack label of what this stack creates (shared/stack_id.py)",
}
# compose's own names (compose/.env, compose/worker-host.yml): the compose files map each onto a
# setting or an image. They also reach a container started with `docker run --env-file
# compose/.env` (docs/compose.md), where Conveyor ignores them. CONVEYOR_RUN_ID is a setting of
# the same name, so it is not listed.
COMPOSE_VARIABLES = frozenset({
    "CONVEYOR_DEMO", "CONVEYOR_DEMO_TASKS", "CONVEYOR_INTAKE_MODE", "CONVEYOR_NUM_GROUPS", "CONVEYOR_GROUP_SIZE",
    "CONVEYOR_MAX_TOKENS_PER_TURN", "CONVEYOR_LR", "CONVEYOR_MASK_OVERLONG", "CONVEYOR_PASS_THRESHOLD",
    "CONVEYOR_GROUPS_PER_STEP", "CONVEYOR_MAX_STEPS", "CONVEYOR_MAX_OFF_POLICY_STEPS",
    "CONVEYOR_REWARD_WEIGHTS", "CONVEYOR_SERVED_MODEL", "CONVEYOR_MODEL_PATH",
    "CONVEYOR_GPU_INFERENCE_IMAGE", "CONVEYOR_INFERENCE_URL", "CONVEYOR_INFERENCE_STARTUP_TIMEOUT_S",
    "CONVEYOR_SERVICE_IMAGE", "CONVEYOR_WORKER_IMAGE", "CONVEYOR_REDIS_IMAGE", "CONVEYOR_S3_IMAGE",
    "CONVEYOR_INFERENCE_DTYPE", "CONVEYOR_INFERENCE_EAGER", "CONVEYOR_MAX_MODEL_LEN", "CONVEYOR_TENSOR_PARALLEL_SIZE",
    "CONVEYOR_GPU_MEMORY_UTILIZATION", "CONVEYOR_LORA", "CONVEYOR_LORA_RANK", "CONVEYOR_LORA_SYNC",
    "CONVEYOR_HEAD",  # compose/worker-host.yml: the head host's address
})
ALLOWED_VARIABLES = frozenset(RUNTIME_VARIABLES) | COMPOSE_VARIABLES


@dataclass(frozen=True)
class SettingNames:
    json_valued: dict[str, bool]  # variable -> whether its value is JSON
    open_prefixes: tuple[str, ...]  # "CONVEYOR_INTAKE__ENV_CONFIG__": any key below a dict setting
    discriminated: dict[str, str]  # "CONVEYOR_INFERENCE__WEIGHT_SYNC" -> "MODE": a union of sections, its tag


def unwrap_optional(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _variants(annotation: Any) -> list[type[BaseModel]]:
    """The models of a discriminated setting (a union of sections), else []."""
    if get_origin(annotation) not in (Union, types.UnionType):
        return []
    args = get_args(annotation)
    return list(args) if all(isinstance(a, type) and issubclass(a, BaseModel) for a in args) else []


def _walk(model: type[BaseModel], prefix: str, names: dict[str, bool], open_prefixes: list[str],
          discriminated: dict[str, str]) -> None:
    for old_name in getattr(model, "FOLDED_NAMES", {}):  # shared.settings.base.Section
        names[f"{prefix}{old_name.upper()}"] = False
    for field_name, field in model.model_fields.items():
        name = f"{prefix}{field_name.upper()}"
        annotation = unwrap_optional(field.annotation)
        origin = get_origin(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names[name] = True
            _walk(annotation, name + DELIMITER, names, open_prefixes, discriminated)
        elif _variants(annotation):  # JSON, or its mode alone (CONVEYOR_INFERENCE__WEIGHT_SYNC=nccl)
            names[name] = False
            discriminated[name] = str(field.discriminator).upper()
            for variant in _variants(annotation):
                _walk(variant, name + DELIMITER, names, open_prefixes, discriminated)
        else:
            names[name] = origin in (dict, list, tuple, set) or annotation in (dict, list, tuple, set)
            if origin is dict or annotation is dict:
                open_prefixes.append(name + DELIMITER)


@lru_cache(maxsize=4)
def setting_names(model: type[BaseModel]) -> SettingNames:
    names: dict[str, bool] = {}
    open_prefixes: list[str] = []
    discriminated: dict[str, str] = {}
    _walk(model, PREFIX, names, open_prefixes, discriminated)
    return SettingNames(names, tuple(open_prefixes), discriminated)


def env_problem(model: type[BaseModel], variable: str, where: str = "environment variable {}") -> str | None:
    """``where`` places the variable in the message: "environment variable {}", "variable {} in ./.env"."""
    name = variable.upper()
    known = setting_names(model)
    if name in known.json_valued or name in ALLOWED_VARIABLES or name.startswith(known.open_prefixes):
        return None
    close = difflib.get_close_matches(name, [*known.json_valued, *ALLOWED_VARIABLES], n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else "settings are CONVEYOR_<SECTION>__<FIELD>, see shared/settings/"
    return f"unknown {where.format(variable)}: {hint}"


def json_problem(model: type[BaseModel], variable: str, value: str, where: str = "environment variable {}") -> str | None:
    if not setting_names(model).json_valued.get(variable.upper()):
        return None
    try:
        json.loads(value)
    except ValueError as exc:
        return f"{where.format(variable)} is not valid JSON: {exc}"
    return None


def _check_variables(model: type[BaseModel], variables: dict[str, str | None], where: str) -> None:
    for name, value in variables.items():
        problem = env_problem(model, name, where) or json_problem(model, name, value or "", where)
        if problem:
            raise SettingsError(problem)
    given = {name.upper(): value for name, value in variables.items()}
    for whole, tag in sorted(setting_names(model).discriminated.items()):
        beneath = sorted(n for n in given if n.startswith(whole + DELIMITER))
        if whole in given and beneath and not (given[whole] or "").lstrip().startswith("{"):
            # its mode alone (not JSON, so not merged with the fields): one would replace the other
            raise SettingsError(f"{where.format(whole)} sets the whole setting, and {beneath[0]} a field of it: "
                                f"set the mode as {whole}{DELIMITER}{tag} instead")


class CheckedEnv(EnvSettingsSource):
    """The environment, after refusing unknown CONVEYOR_* names and JSON settings that are not JSON."""

    def __call__(self) -> dict[str, Any]:
        _check_variables(self.settings_cls, {k: v for k, v in os.environ.items() if k.upper().startswith(PREFIX)}, "environment variable {}")
        return super().__call__()


class CheckedDotEnv(DotEnvSettingsSource):
    """``./.env``: settings only; a line that is not ``NAME=value`` is refused with its number.
    Other names are not exported to the process, so a runtime variable (CONVEYOR_CONFIG,
    CONVEYOR_LOG_LEVEL) there would be silently ignored: refused too."""

    def __init__(self, settings_cls: type[BaseSettings], env_file: Path = Path(".env")):
        if env_file.is_file():
            try:
                bad = next((b for b in parse_stream(io.StringIO(env_file.read_text("utf-8"))) if b.error), None)
            except UnicodeDecodeError as exc:
                raise SettingsError(f"{env_file.resolve()}: not UTF-8 text: {exc}") from None
            if bad is not None:
                raise SettingsError(f"{env_file.resolve()}:{bad.original.line}: not a NAME=value line")
        super().__init__(settings_cls, env_file=env_file)

    def __call__(self) -> dict[str, Any]:
        path = Path(str(self.env_file)).resolve()
        ours = {k.upper(): v for k, v in self.env_vars.items() if k.upper().startswith(PREFIX)}
        misplaced = sorted(ours.keys() & RUNTIME_VARIABLES.keys())
        if misplaced:
            raise SettingsError(f"{misplaced[0]} in {path} has no effect there: set it in the environment")
        _check_variables(self.settings_cls, ours, f"variable {{}} in {path}")
        self.env_vars = {k.lower(): v for k, v in ours.items() if k not in ALLOWED_VARIABLES}
        return super().__call__()


class CheckedYaml(YamlConfigSettingsSource):
    """The YAML file; a syntax error names the file and line, and the top level must be a mapping."""

    def _read_file(self, file_path: Any) -> dict[str, Any]:
        try:
            data = super()._read_file(file_path)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = f":{mark.line + 1}" if mark else ""
            raise SettingsError(f"{file_path}{line}: not valid YAML: {exc.problem or exc.context}") from None
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise SettingsError(f"{file_path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict) or not all(isinstance(key, str) for key in data):
            raise SettingsError(f"{file_path}: the top level must map setting names to values")
        return data
