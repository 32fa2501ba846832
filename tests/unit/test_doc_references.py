"""Every dotted module name and every code path that a docstring or a doc cites resolves in the
code as it is.

What counts as a cited name: a dotted name that starts with one of Conveyor's top-level folders
(``services.``, ``shared.``, ``bench.``, ``tests.``) and is not itself part of a path or of a
longer dotted name, e.g. ``shared.outage.Dependency.call``, ``python -m services.cli.state_map``
or ``shared.ids:group_seed``. A name whose last part is a file extension (``tests.txt``) is a
file name, not a module. Where it is looked for: the docstrings (module, class and function) of
every module under services/, shared/ and bench/, and README.md and docs/**/*.md.

How it resolves, without importing anything (torch and vLLM stay unloaded): the longest prefix
that is a module file, a package or a namespace folder under the repository root; then each
remaining part is a top-level definition of that module (def, class, assignment or import), and
each part after that a definition in the body of the class before it.

A cited path is one that starts with one of the same folders and a slash (``shared/state/ledger.py``,
``services/rollout_worker/sandbox/``); it must exist in the repository. A path with a
placeholder (``{run_id}``, ``*``) is a pattern, not a file, and is left out.

A relative Markdown link in README.md or docs/ (``[compose.md](compose.md#images)``) points at a
file that exists and, with an anchor, at one of its headings, slugged as GitHub slugs them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP_LEVEL = ("services", "shared", "bench", "tests")
CITED = re.compile(r"(?<![\w/.:-])((?:" + "|".join(TOP_LEVEL) + r")(?:[.:][A-Za-z_]\w*)+)")
CITED_PATH = re.compile(r"(?<![\w/.-])((?:" + "|".join(TOP_LEVEL) + r")/[\w./{}*-]*[\w/])")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#+ (.*)$", re.MULTILINE)
FILE_EXTENSIONS = {"py", "txt", "sha256", "md", "json", "jsonl", "yml", "yaml", "toml", "gz", "png", "patch", "sh"}


def cited_names(text: str) -> list[str]:
    names = [match.group(1).replace(":", ".") for match in CITED.finditer(text)]
    return [name for name in names if name.rsplit(".", 1)[-1] not in FILE_EXTENSIONS]


def cited_paths(text: str) -> list[str]:
    paths = [match.group(1) for match in CITED_PATH.finditer(text)]
    return [path for path in paths if not any(mark in path for mark in "{}*")]


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_link(page: Path, link: str) -> str | None:
    """Why the relative ``link`` on ``page`` leads nowhere, or None when it leads somewhere."""
    target, _, anchor = link.partition("#")
    path = (page.parent / target).resolve() if target else page
    if not path.exists():
        return f"no file {target}"
    if anchor and path.suffix == ".md" and anchor not in map(heading_anchor, HEADING.findall(path.read_text())):
        return f"{path.relative_to(ROOT)} has no heading #{anchor}"
    return None


def docstrings(path: Path):
    """(line, docstring) of the module and of each class and function in it."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield getattr(node, "lineno", 1), text


def citations(find) -> list[tuple[str, str]]:
    """(where, citation) for everything ``find`` picks out of the product's docstrings and the docs."""
    found = []
    for folder in ("services", "shared", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, text in docstrings(path):
                found += [(f"{path.relative_to(ROOT)}:{line}", cited) for cited in find(text)]
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for line, text in enumerate(path.read_text().splitlines(), 1):
            found += [(f"{path.relative_to(ROOT)}:{line}", cited) for cited in find(text)]
    return found


def module_source(parts: list[str]) -> Path | None:
    """The file (or, for a namespace folder, the folder) that the dotted module ``parts`` names."""
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return base if base.is_dir() else None


def definitions(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """Each name a module or class body binds, with the statement that binds it."""
    bound: dict[str, ast.stmt] = {}
    for statement in body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound[statement.name] = statement
        elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            bound.update((node.id, statement) for target in targets for node in ast.walk(target)
                         if isinstance(node, ast.Name))
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            bound.update(((alias.asname or alias.name).split(".")[0], statement) for alias in statement.names)
        elif isinstance(statement, (ast.If, ast.Try)):
            bound.update(definitions(statement.body))
    return bound


def unresolved(name: str) -> str | None:
    """Why ``name`` does not resolve, or None when it does."""
    parts = name.split(".")
    cut = next((cut for cut in range(len(parts), 0, -1) if module_source(parts[:cut])), 0)
    if cut == 0:
        return f"no module {parts[0]}"
    source, attributes = module_source(parts[:cut]), parts[cut:]
    if not attributes:
        return None
    if source.is_dir():
        return f"no module {'.'.join(parts[:cut + 1])}"
    body = ast.parse(source.read_text(), str(source)).body
    for depth, attribute in enumerate(attributes):
        owner = ".".join(parts[:cut + depth])
        statement = definitions(body).get(attribute)
        if statement is None:
            return f"{owner} defines no {attribute}"
        if depth < len(attributes) - 1:
            if not isinstance(statement, ast.ClassDef):
                return f"{owner}.{attribute} is not a class, so it has no {attributes[depth + 1]}"
            body = statement.body
    return None


def test_the_scan_reads_the_forms_a_doc_cites():
    text = ("see ``shared.outage.Dependency.call``; run `python -m services.cli.state_map --write`; "
            "`shared.ids:group_seed`; not services/cli/app.py, tests.txt, my_pkg.shared.x or every services.")
    assert cited_names(text) == ["shared.outage.Dependency.call", "services.cli.state_map", "shared.ids.group_seed"]


def test_the_scan_reads_the_paths_a_doc_cites():
    text = ("`shared/state/ledger.py` and services/rollout_worker/sandbox/, then tests/unit/test_ids.py::test_x; "
            "not .../sandbox/deployment.py, docs/images/a.png or `trajectories/{run_id}/` nor shared/*.py.")
    assert cited_paths(text) == ["shared/state/ledger.py", "services/rollout_worker/sandbox/", "tests/unit/test_ids.py"]


def test_a_link_leads_to_a_file_and_a_heading():
    assert heading_anchor("Steady offered load (`--offered-load`)") == "steady-offered-load---offered-load"
    page = ROOT / "docs" / "performance.md"
    assert broken_link(page, "performance/capacity.md#steady-offered-load---offered-load") is None
    assert broken_link(page, "performance/no_such_page.md") == "no file performance/no_such_page.md"
    assert broken_link(page, "learning.md#no-such-heading") == "docs/learning.md has no heading #no-such-heading"


def test_a_name_resolves_only_when_its_module_and_attributes_exist():
    assert unresolved("services.cli.state_map") is None
    assert unresolved("shared.outage.Dependency.call") is None
    assert unresolved("shared.schemas.RolloutRequest.task_seed") is None
    assert unresolved("bench.capacity") is None and unresolved("shared.environments") is None
    assert unresolved("shared.ids.task_seed") == "shared.ids defines no task_seed"
    assert unresolved("shared.no_such_module") == "shared defines no no_such_module"
    assert unresolved("shared.ids.group_seed.real") == "shared.ids.group_seed is not a class, so it has no real"
    assert unresolved("bench.no_such_bench") == "no module bench.no_such_bench"


def test_every_dotted_module_name_in_a_docstring_or_a_doc_resolves():
    found = citations(cited_names)
    assert len(found) > 100, "the scan found too few citations to be reading the docs"
    broken = [f"{where}: {name}: {why}" for where, name in found if (why := unresolved(name))]
    assert not broken, "cited names that do not resolve:\n" + "\n".join(broken)


def test_every_code_path_in_a_docstring_or_a_doc_exists():
    found = citations(cited_paths)
    assert len(found) > 100, "the scan found too few paths to be reading the docs"
    missing = [f"{where}: {path}" for where, path in found if not (ROOT / path).exists()]
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_every_relative_link_in_the_docs_leads_to_a_file_and_a_heading():
    links = [(page, link) for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
             for link in MARKDOWN_LINK.findall(page.read_text()) if "://" not in link]
    assert len(links) > 50, "the scan found too few links to be reading the docs"
    broken = [f"{page.relative_to(ROOT)}: {link}: {why}" for page, link in links if (why := broken_link(page, link))]
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)
