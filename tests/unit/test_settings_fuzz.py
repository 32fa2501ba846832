"""Fuzz the settings loader: whatever the environment, ./.env or the YAML file hold, loading
either returns Settings or raises the documented SettingsError, never anything else.

Examples per target: FUZZ_EXAMPLES, as every fuzz target of the suite (tests/fuzz_support.py;
default 200, for a fast run; 10000 locally for the issue's figure). SETTINGS_FUZZ_EXAMPLES still
works. Neither has the CONVEYOR_ prefix, so the loader does not see them.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator

import pytest
import yaml
from fuzz_support import FUZZ
from hypothesis import event, given, strategies as st
from pydantic import BaseModel

from shared.settings import Settings, SettingsError, load_settings
from shared.settings_sources import ALLOWED_VARIABLES, setting_names, unwrap_optional


KNOWN_NAMES = sorted(setting_names(Settings).json_valued)
text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), text)
json_like = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=8)
known_names = st.sampled_from(KNOWN_NAMES) | st.sampled_from(sorted(ALLOWED_VARIABLES - {"CONVEYOR_CONFIG"}))
any_names = st.from_regex(r"CONVEYOR_[A-Za-z0-9_]{0,30}", fullmatch=True)  # typos, and sometimes CONVEYOR_CONFIG
names = known_names | any_names
values = st.one_of(
    text, json_like.map(json.dumps), st.integers().map(str),
    st.sampled_from(["", "true", "false", "null", "1e400", "NaN", "-0", "0x10", "[1,", "{}", '{"reward_fn": "x:y"}']),
)


def model_like(model: type[BaseModel]) -> st.SearchStrategy[dict]:
    """Documents shaped like the settings model, with random values and sometimes a stray key."""
    optional = {}
    for name, field in model.model_fields.items():
        annotation = unwrap_optional(field.annotation)
        nested = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        optional[name] = st.deferred(lambda a=annotation: model_like(a)) | scalars if nested else json_like
    optional["bogus"] = scalars
    return st.fixed_dictionaries({}, optional=optional)


@contextlib.contextmanager
def conveyor_environment(variables: dict[str, str], cwd: Path) -> Iterator[None]:
    """Exactly these CONVEYOR_* variables and this directory while loading; the old ones after."""
    saved = {k: v for k, v in os.environ.items() if k.upper().startswith("CONVEYOR_")}
    for name in saved:
        del os.environ[name]
    os.environ.update(variables)
    try:
        with contextlib.chdir(cwd):
            yield
    finally:
        for name in [k for k in os.environ if k.upper().startswith("CONVEYOR_")]:
            del os.environ[name]
        os.environ.update(saved)


def loads_or_refuses(yaml_file: Path | None = None) -> None:
    try:
        load_settings(yaml_file)
        event("loaded")  # --hypothesis-show-statistics: how often each outcome came up
    except SettingsError as exc:
        assert str(exc)  # the documented failure, with a message
        event("refused: " + " ".join(str(exc).split()[:2]))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("settings-fuzz")


@FUZZ
@given(known=st.dictionaries(known_names, values, max_size=6), other=st.just({}) | st.dictionaries(any_names, values, max_size=1))
def test_environment_variables(workdir, known, other):
    (workdir / ".env").unlink(missing_ok=True)
    with conveyor_environment({**known, **other}, workdir):
        loads_or_refuses()


@FUZZ
@given(document=st.one_of(model_like(Settings).map(yaml.safe_dump), json_like.map(yaml.safe_dump), text, st.binary(max_size=60)))
def test_yaml_file(workdir, document):
    (workdir / ".env").unlink(missing_ok=True)
    path = workdir / "settings.yaml"
    path.write_bytes(document if isinstance(document, bytes) else document.encode())
    with conveyor_environment({}, workdir):
        loads_or_refuses(path)


line = st.one_of(st.tuples(names, values).map(lambda nv: f"{nv[0]}={nv[1]}".replace("\n", " ")), text, st.just("# a comment"))


@FUZZ
@given(content=st.one_of(st.lists(line, max_size=5).map("\n".join), st.binary(max_size=60)))
def test_dotenv_file(workdir, content):
    (workdir / ".env").write_bytes(content if isinstance(content, bytes) else content.encode())
    with conveyor_environment({}, workdir):
        loads_or_refuses()
