"""Conveyor's trusted pytest runner. NOT imported by Conveyor: the grader copies this file into
the verification sandbox (root-owned, read-only for the sandbox user) and runs it as

    python3 -I RUNNER WORKSPACE NODE_ID... 3>REPORT 4<KEY

Design (threat model and remaining risks: ``grading``'s docstring and docs/security.md):

- Everything trusted happens before any code of the workspace runs ("arming"): the key is read
  from descriptor 4 and closed, the process makes itself non-dumpable (so no other process of
  the sandbox user can read its memory, and ``/proc/self/mem`` is root's), pytest and its
  plugins are imported, the graded test files (and every ``.py`` file beside them) are read and
  checked against the hashes root took (``tests.sha256``), and a PEP 578 audit hook is
  installed. An audit hook cannot be removed, and the hook refuses every later
  ``sys.addaudithook``.
- The signing capability (an HMAC object) lives only in the hook's closure. No module, class or
  object that test code can reach refers to it, and the hook never calls code of the workspace.
- The hook blocks: ``sys.settrace``/``sys.setprofile``, the ``gc`` introspection calls,
  ``sys._current_frames``, every ``ctypes`` event, new audit hooks, opening ``/proc/*/mem``;
  frames (``sys._getframe``, ``tb_frame``, ``gi_frame``, ``cr_frame``, ``ag_frame``) unless taken by
  trusted code with only trusted code on the stack, or by one of a few standard-library sites
  that only read a module name or format a traceback; writes to ``__code__`` (but
  ``types.coroutine``'s flag), to ``__defaults__``/``__kwdefaults__`` of trusted functions, to
  ``__class__`` of pytest's, pluggy's or the runner's modules; and ``signal.signal`` with a handler
  that is not trusted code. A refused event writes a signed ``refused`` record and ends the
  process at once (status 86): no exception, no traceback, no second try.
- "Trusted code" is a code object that existed when the hook was armed (the standard library,
  pytest, pluggy, this runner), or one equal to what compiling its file gives, for files of the
  interpreter's own ``sys.path`` that the sandbox user cannot write, for the graded test files as
  read at arming, and for the repository's own files: ``.py`` files of the workspace that the
  agent's diff does not touch (``touched.txt``), with the bytes root hashed before the run
  (``repo.sha256``). A code object forged with a trusted file name is not equal, so not trusted.
- Evidence of a pass is written only by the hook, only in the original process and its main
  thread, only when every frame on the stack is trusted code and the caller is this runner's
  own call site. For a test function, the runner calls the test itself
  (``pytest_pyfunc_call``): before the call the hook checks that the function is the graded
  file's own code for that node id, that the test module's imported names are still the
  objects they were imported from, that pytest's, pluggy's and the runner's functions and
  classes and the builtins are the ones armed, and it writes ``ran`` only once the call has
  returned normally and the same checks hold again. For a unittest method the same checks
  surround pytest's call. Every phase report is recorded (``phase``); the last record
  (``finish``) has pytest's exit status.
- Results go to descriptor 3, a file in a root-only directory, one JSON record per line, each
  signed with HMAC-SHA256. The grader trusts a record set only if every signature checks, the
  sequence numbers are contiguous, the final record is present, its exit status equals the
  status the root shell saw, and nothing was refused or tampered with (``grading.read_report``).
"""

import ast
import builtins
import hashlib
import json
import os
import signal
import sys
import threading
import traceback
import types

REFUSED_STATUS = 86
_FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
_ALWAYS_REFUSED = frozenset({"sys.settrace", "sys.setprofile", "sys._current_frames", "gc.get_objects",
                             "gc.get_referrers", "gc.get_referents", "sys.addaudithook"})
_PROTECTED_PREFIXES = ("_pytest", "pytest", "pluggy", "__main__")


def _read_key():
    key = bytearray(os.read(4, 256).strip())
    os.close(4)
    return key


def _make_nondumpable():
    """prctl(PR_SET_DUMPABLE, 0): the sandbox user's other processes cannot read this one's memory."""
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0
    except (OSError, AttributeError, ImportError):
        return False


def _codes_of(value, out, seen):
    """Code objects reachable from a module-level value (functions, classes, nested code)."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, types.CodeType):
        out[id(value)] = value
        for const in value.co_consts:
            if isinstance(const, types.CodeType):
                _codes_of(const, out, seen)
    elif isinstance(value, (types.FunctionType, types.MethodType)):
        _codes_of(getattr(value, "__func__", value).__code__, out, seen)
    elif isinstance(value, (staticmethod, classmethod)):
        _codes_of(value.__func__, out, seen)
    elif isinstance(value, property):
        for part in (value.fget, value.fset, value.fdel):
            if part is not None:
                _codes_of(part, out, seen)
    elif isinstance(value, type):
        for member in list(vars(value).values()):
            _codes_of(member, out, seen)


def _armed_codes():
    out, seen = {}, set()
    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            _codes_of(value, out, seen)
    return out


def _protected_state():
    """[(owner dict, names, values)]: every function and class in pytest's, pluggy's and this
    runner's modules and classes, and every builtin: what must still be there at each check."""
    owners = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(_PROTECTED_PREFIXES):
            continue
        for attr, value in list(vars(module).items()):
            if callable(value):
                owners.setdefault(id(vars(module)), (vars(module), {}))[1][attr] = value
            if isinstance(value, type) and getattr(value, "__module__", "").startswith(_PROTECTED_PREFIXES):
                members = {a: v for a, v in list(value.__dict__.items())
                           if callable(v) or isinstance(v, (property, staticmethod, classmethod))}
                owners.setdefault(id(value), (value.__dict__, {}))[1].update(members)
    owners[id(builtins)] = (vars(builtins), {a: v for a, v in list(vars(builtins).items()) if callable(v)})
    return [(owner, tuple(entries), tuple(entries.values())) for owner, entries in owners.values()]


def _imports_of(tree):
    """name -> ((module, attribute or None), ...) bound by the module's absolute import statements."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".", 1)[0]
                found.setdefault(bound, []).append((alias.name if alias.asname else bound, None))
        elif isinstance(node, ast.ImportFrom) and not node.level and not any(a.name == "*" for a in node.names):
            for alias in node.names:
                found.setdefault(alias.asname or alias.name, []).append((node.module, alias.name))
    return {name: tuple(origins) for name, origins in found.items()}


def _read_sources(workspace, node_ids):
    """(path -> bytes of the graded test files and every ``.py`` file in their directories,
    the graded files' paths)."""
    texts = {}
    files = sorted({i.split("::", 1)[0] for i in node_ids if "::" in i})
    dirs = sorted({os.path.dirname(f) for f in files if os.path.dirname(f)})
    names = [*files, *(os.path.join(d, e) for d in dirs if os.path.isdir(os.path.join(workspace, d))
                       for e in sorted(os.listdir(os.path.join(workspace, d))) if e.endswith(".py"))]
    for rel in names:
        path = os.path.join(workspace, rel)
        if path not in texts and not os.path.islink(path) and os.path.isfile(path):
            with open(path, "rb") as source:
                texts[path] = source.read()
    return texts, [os.path.join(workspace, f) for f in files]


def _make_hook(key, fd, texts, graded, trusted_dirs, workspace, repo_hashes):
    """The audit hook and the runner's call sites it accepts evidence from. Everything it uses
    is captured here, at arming (builtins and functions included): nothing that code under test
    rebinds later changes what it does."""
    cap = __import__("_hashlib").hmac_new(bytes(key), digestmod="sha256")
    for i in range(len(key)):
        key[i] = 0
    esc, write, exit_now, getframe = json.encoder.encode_basestring_ascii, os.write, os._exit, sys._getframe
    getpid, get_ident, realpath, access, w_ok = os.getpid, threading.get_ident, os.path.realpath, os.access, os.W_OK
    _type, _id, _sorted, _any, _all, _compile, _open = type, id, sorted, any, all, compile, open
    _issubclass, _tuple, _set = issubclass, tuple, set
    pid, main_thread, modules = os.getpid(), threading.get_ident(), sys.modules
    code_type, str_type, int_type = types.CodeType, str, int
    function_type, method_type, module_type = types.FunctionType, types.MethodType, types.ModuleType
    module_dict = types.ModuleType.__dict__["__dict__"].__get__
    gc_enable, gc_disable, gc_isenabled = __import__("gc").enable, __import__("gc").disable, __import__("gc").isenabled
    trusted = _armed_codes()
    protected = _protected_state()
    is_, _map = __import__("operator").is_, map
    compiled = {path: _compile(texts[path], path, "exec", dont_inherit=True) for path in graded if path in texts}
    imports = {path: _imports_of(ast.parse(texts[path])) for path in graded if path in texts}
    inside = workspace + "/"
    sha256 = hashlib.sha256
    state = {"seq": 0, "pending": None, "tampered": [], "walking": _set(), "file_cache": {}}
    call_sites = _set()  # code objects of the runner's emitting functions, filled by ``accept``
    safe_direct, safe_pairs = _stdlib_frame_sites()
    code_setter = types.coroutine.__code__
    grader_modules = {}  # id -> module: pytest's, pluggy's and the runner's modules

    def line(record):
        parts = []
        for name in _sorted(record):
            value = record[name]
            if _type(value) is str_type:
                text = esc(value)
            elif value is True or value is False:
                text = "true" if value else "false"
            elif _type(value) is int_type:
                text = int_type.__repr__(value)
            else:  # a tuple of strings
                text = "[" + ", ".join([esc(v) for v in value]) + "]"
            parts.append(esc(name) + ": " + text)
        body = ("{" + ", ".join(parts) + ", \"seq\": " + int_type.__repr__(state["seq"]) + "}").encode()
        mac = cap.copy()
        mac.update(body)
        write(fd, body + b" " + mac.hexdigest().encode() + b"\n")
        state["seq"] += 1

    def find_equal(module_code, code):
        stack = [module_code]
        while stack:
            current = stack.pop()
            if current.co_qualname == code.co_qualname and current.co_firstlineno == code.co_firstlineno \
                    and current == code:
                return True
            stack.extend([c for c in current.co_consts if _type(c) is code_type])
        return False

    def module_code_of(filename):
        if filename in texts:
            if filename not in compiled:
                try:
                    compiled[filename] = _compile(texts[filename], filename, "exec", dont_inherit=True)
                except (SyntaxError, ValueError):
                    compiled[filename] = None
            return compiled[filename]
        real = realpath(filename)
        digest = repo_hashes.get(real[len(inside):]) if real.startswith(inside) else None
        if digest is None and (real.startswith(inside) or not real.startswith(trusted_dirs) or access(real, w_ok)):
            return None
        cache = state["file_cache"]
        if real not in cache:
            try:
                with _open(real, "rb") as source:
                    data = source.read()
                # a file of the repository counts only with the bytes root hashed before the run
                ok = digest is None or sha256(data).hexdigest() == digest
                cache[real] = _compile(data, filename, "exec", dont_inherit=True) if ok else None
            except (OSError, SyntaxError, ValueError):
                cache[real] = None
        return cache[real]

    def genuine(code):
        if trusted.get(_id(code)) is code:
            return True
        filename = code.co_filename
        if _type(filename) is not str_type:
            return False
        module_code = module_code_of(filename)
        if module_code is None or not find_equal(module_code, code):
            return False
        trusted[_id(code)] = code
        return True

    def caller_frame(depth):
        """The frame ``depth`` levels above the hook (the hook's own look is let through)."""
        me = get_ident()
        state["walking"].add(me)
        try:
            return getframe(depth + 1)
        finally:
            state["walking"].discard(me)

    def stack_trusted(frame):
        while frame is not None:
            if not genuine(frame.f_code):
                return False
            frame = frame.f_back
        return True

    def place(frame):
        filename = frame.f_code.co_filename
        return (filename if _type(filename) is str_type else "?") + ":" + int_type.__repr__(frame.f_lineno or 0)

    def where(frame):
        """The youngest frame of code under test on the stack, else the youngest frame."""
        youngest = frame
        while frame is not None and genuine(frame.f_code):
            frame = frame.f_back
        if frame is not None:
            return place(frame)
        return "trusted code only, at " + place(youngest) if youngest is not None else "?"

    def refuse(event, detail, frame):
        if getpid() == pid:
            line({"kind": "refused", "event": event, "detail": detail, "where": where(frame)})
        exit_now(REFUSED_STATUS)

    def frame_allowed(frame):
        if frame is None:
            return True
        code = frame.f_code
        if safe_direct.get(code) is code:
            return True
        consumer = frame.f_back
        if code in safe_pairs and consumer is not None and consumer.f_code in safe_pairs[code]:
            return True
        return genuine(code) and stack_trusted(frame)

    def trusted_value(value):
        """A function (or property, static or class method of one) whose code is trusted: what
        pytest's own plugins install at configure time (``legacypath``), never code under test."""
        if _type(value) in (staticmethod, classmethod):
            value = value.__func__
        if _type(value) is property:
            return _all([part is None or trusted_value(part) for part in (value.fget, value.fset, value.fdel)])
        return _type(value) is function_type and genuine(value.__code__)

    def intact():
        """None if every protected name still holds its armed value (or a trusted replacement,
        which becomes the value to hold); else what was replaced. The loop over the names of
        one owner runs in C (``map``, ``is_``): a check costs tens of microseconds."""
        for index, (owner, names, values) in enumerate(protected):
            if _all(_map(is_, _map(owner.get, names), values)):
                continue
            now = _tuple(_map(owner.get, names))
            for name, old, new in zip(names, values, now):
                if new is not old and not trusted_value(new):
                    return name + " was replaced"
            protected[index] = (owner, names, now)
        return None

    def namespace_ok(function):
        """The test module's imported names are still the objects they were imported from."""
        spaces = function.__globals__
        for name, origins in imports.get(function.__code__.co_filename, {}).items():
            if name not in spaces:
                continue
            candidates = []
            for module_name, attr in origins:
                module = modules.get(module_name)
                if module is None:
                    continue
                if not _issubclass(_type(module), module_type):
                    return name + ": " + module_name + " is not a module"
                if attr is None:
                    candidates.append(module)
                    continue
                value = module_dict(module).get(attr, modules.get(module_name + "." + attr))
                if value is not None:
                    candidates.append(value)
            if candidates and not _any([spaces[name] is c for c in candidates]):
                return name + " is not what " + origins[0][0] + " gives"
        return None

    def test_code_ok(nodeid, function):
        """``function`` is the graded file's own test for ``nodeid``: wrappers (decorators) must be
        trusted code, and the innermost function the graded file's code of that name."""
        for _ in range(20):
            if _type(function) is method_type:
                function = function.__func__
            if _type(function) is not function_type:
                return "the test is not a plain function"
            wrapped = function.__dict__.get("__wrapped__")
            if wrapped is None:
                break
            if not genuine(function.__code__):
                return "the test is wrapped by code under test"
            function = wrapped
        code = function.__code__
        path = inside + nodeid.split("::", 1)[0]
        name = nodeid.split("::")[-1].split("[", 1)[0]
        if code.co_filename != path or code.co_name != name or path not in compiled:
            return "the test's code comes from " + str_type(code.co_filename) + ":" + str_type(code.co_name)
        if not find_equal(compiled[path], code):
            return "the test's code is not the graded file's"
        return namespace_ok(function)

    def checks(nodeid, function):
        return intact() or test_code_ok(nodeid, function)

    def evidence(event, args, frame):
        if getpid() != pid or get_ident() != main_thread or frame is None or frame.f_code not in call_sites \
                or not stack_trusted(frame):
            refuse(event, "evidence from outside the runner's own call site", frame)
        was_enabled = gc_isenabled()
        gc_disable()  # no finalizer runs between the checks and the record
        try:
            if event == "conveyor.call":
                nodeid, function = args
                problem = checks(nodeid, function)
                state["pending"] = None if problem else (nodeid, function)
                if problem:
                    line({"kind": "not_genuine", "nodeid": nodeid, "why": problem})
            elif event == "conveyor.returned":
                nodeid, function = args
                pending, state["pending"] = state["pending"], None
                problem = checks(nodeid, function)
                if problem:
                    line({"kind": "not_genuine", "nodeid": nodeid, "why": problem})
                elif pending is not None and pending[0] == nodeid and pending[1] is function:
                    line({"kind": "ran", "nodeid": nodeid})
            elif event == "conveyor.phase":
                nodeid, when, outcome, xfail = args
                problem = intact()
                if problem:
                    state["tampered"].append(problem)
                line({"kind": "phase", "nodeid": nodeid, "when": when, "outcome": outcome, "xfail": xfail})
            elif event == "conveyor.finish":
                exitstatus, plugins_added, problems = args
                problem = intact()
                tampered = _tuple(state["tampered"] + ([problem] if problem else []))
                line({"kind": "finish", "exitstatus": exitstatus, "tampered": tampered,
                      "plugins_added": plugins_added, "problems": problems})
        finally:
            if was_enabled:
                gc_enable()

    def hook(event, args):
        if _type(event) is not str_type:
            refuse("audit", "an event name that is not a str", caller_frame(1))
        if event.startswith("conveyor."):
            return evidence(event, args, caller_frame(1))
        if event in _ALWAYS_REFUSED or event.startswith("ctypes."):
            refuse(event, "", caller_frame(1))
        elif event == "sys._getframe":
            if get_ident() in state["walking"]:
                return
            if not frame_allowed(caller_frame(1)):
                refuse(event, "", caller_frame(1))
        elif event == "object.__getattr__":
            name = args[1]
            if _type(name) is str_type and name in _FRAME_ATTRS and not frame_allowed(caller_frame(1)):
                refuse(event, name, caller_frame(1))
        elif event == "object.__setattr__":
            target, name = args[0], args[1]
            if _type(name) is not str_type:
                return
            if name == "__code__":
                frame = caller_frame(1)
                if frame is None or frame.f_code is not code_setter:  # types.coroutine flags a generator
                    refuse(event, name, frame)
            if name in ("__defaults__", "__kwdefaults__") and _type(target) is function_type \
                    and genuine(target.__code__):
                refuse(event, name + " of trusted code", caller_frame(1))
            if name == "__class__" and _id(target) in grader_modules:
                refuse(event, "__class__ of a protected module", caller_frame(1))
        elif event == "open":
            path = args[0]
            if _type(path) is bytes:
                path = path.decode(errors="replace")
            if _type(path) is str_type and path.endswith("mem") and realpath(path).startswith("/proc/"):
                refuse(event, path, caller_frame(1))

    def accept(*codes):
        call_sites.update(codes)

    def protect_module(module):
        grader_modules[_id(module)] = module

    def signal_guard(original):
        allowed = (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler)

        def guarded_signal(signum, handler):
            plain = handler.__func__ if _type(handler) is method_type else handler
            if not (_any([handler is a for a in allowed]) or _type(handler) is int_type
                    or (_type(plain) is function_type and genuine(plain.__code__))):
                refuse("signal.signal", "a handler from code under test", caller_frame(1))
            return original(signum, handler)
        trusted[_id(guarded_signal.__code__)] = guarded_signal.__code__
        return guarded_signal

    return hook, accept, protect_module, signal_guard


def _stdlib_frame_sites():
    """Standard-library code that takes a frame only to read a module name or to format a
    traceback, never handing a frame to its caller: ``{code}`` and ``{producer: {consumers}}``."""
    direct = [traceback.extract_stack, traceback.format_stack, traceback.print_stack, traceback.clear_frames]
    for owner, name in (("collections", "namedtuple"), ("typing", "_caller"), ("inspect", "getgeneratorstate"),
                        ("inspect", "getcoroutinestate")):
        function = getattr(sys.modules.get(owner) or __import__(owner), name, None)
        if function is not None:
            direct.append(function)
    enum = __import__("enum")
    create = getattr(enum.EnumType, "_create_", None)
    if create is not None:
        direct.append(create)
    codes = {getattr(f, "__func__", f).__code__: getattr(f, "__func__", f).__code__ for f in direct}
    import logging
    extract = traceback.StackSummary.extract.__func__.__code__
    nested = [c for c in extract.co_consts if isinstance(c, types.CodeType)]
    from_gen = traceback.StackSummary._extract_from_extended_frame_gen.__func__.__code__
    pairs = {traceback.walk_tb.__code__: {*nested, from_gen}, traceback.walk_stack.__code__: {*nested, from_gen},
             logging.currentframe.__code__: {logging.Logger.findCaller.__code__}}
    full = getattr(traceback, "_walk_tb_with_full_positions", None)
    if full is not None:
        pairs[full.__code__] = {from_gen, *nested}
    return codes, pairs


def _expected_hashes():
    """``sha256sum`` of the graded test files, written by root before the run (``tests.sha256``)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests.sha256")
    hashes = {}
    with open(path) as listing:
        for entry in listing:
            digest, _, name = entry.rstrip("\n").partition("  ")
            hashes[name] = digest
    return hashes


def _repository_hashes(here):
    """relative path -> sha256 of the workspace's ``.py`` files as root hashed them before the run,
    less every path the agent's diff touches: the repository's own code, unchanged."""
    def listing(name):
        try:
            with open(os.path.join(here, name)) as source:
                return source.read().splitlines()
        except OSError:
            return []
    touched = set(listing("touched.txt"))
    hashes = {}
    for entry in listing("repo.sha256"):
        digest, _, name = entry.partition("  ")
        if entry.startswith("\\") or not name.startswith("./"):
            continue  # sha256sum escapes odd names: never trusted
        if name[2:] not in touched:
            hashes[name[2:]] = digest
    return hashes


def _changed_files(workspace, hashes, texts=None):
    """Graded test files whose contents differ from root's hashes (read now, or as read at arming)."""
    changed = []
    for name, digest in hashes.items():
        path = os.path.join(workspace, name)
        if texts is not None:
            data = texts.get(path)
        else:
            try:
                with open(path, "rb") as source:
                    data = source.read()
            except OSError:
                data = None
        if data is None or hashlib.sha256(data).hexdigest() != digest:
            changed.append(name)
    return tuple(sorted(changed))


def _trusted_module(plugin):
    """A conftest.py (protected: the repository's own) or a module installed outside the workspace."""
    where = getattr(plugin, "__file__", None)
    if not isinstance(where, str) or type(plugin).__name__ != "module":
        return False
    real = os.path.realpath(where)
    return real.endswith("/conftest.py") or not real.startswith(os.path.realpath(os.getcwd()) + "/")


def _make_guard(pytest, audit, unittest_item):
    """The pytest plugin: it forwards evidence to the hook from call sites the hook knows. What it
    uses comes in default arguments, which code under test cannot rebind (``__defaults__`` writes
    to trusted functions are refused)."""

    class Guard:
        def __init__(self):
            self.plugins, self.added = None, ("the session never finished",)

        @pytest.hookimpl(trylast=True)
        def pytest_configure(self, config):
            """The debugging plugin keeps the config in a class attribute: no way from a module to it."""
            debugging = sys.modules.get("_pytest.debugging")
            if debugging is not None:
                debugging.pytestPDB._config = debugging.pytestPDB._pluginmanager = None

        @pytest.hookimpl(tryfirst=True)
        def pytest_collection(self, session):
            self.plugins = {id(p) for p in session.config.pluginmanager.get_plugins()}

        @pytest.hookimpl(tryfirst=True)
        def pytest_pyfunc_call(self, pyfuncitem, _audit=audit, _getattr=getattr, _hasattr=hasattr):
            testfunction = pyfuncitem.obj
            nodeid = pyfuncitem.nodeid
            code = _getattr(_getattr(testfunction, "__func__", testfunction), "__code__", None)
            if code is None or code.co_flags & 0x380:  # a coroutine or async generator: pytest skips it
                return None
            funcargs = pyfuncitem.funcargs
            testargs = {arg: funcargs[arg] for arg in pyfuncitem._fixtureinfo.argnames}
            _audit("conveyor.call", nodeid, testfunction)
            result = testfunction(**testargs)
            _audit("conveyor.returned", nodeid, testfunction)
            if _hasattr(result, "__await__") or _hasattr(result, "__aiter__"):
                return None
            return True

        @pytest.hookimpl(hookwrapper=True, tryfirst=True)
        def pytest_runtest_call(self, item, _audit=audit, _type=type, _unittest=unittest_item):
            if _type(item) is not _unittest:
                yield
                return
            testfunction, nodeid = item.obj, item.nodeid
            _audit("conveyor.call", nodeid, testfunction)
            outcome = yield
            if outcome.excinfo is None and not item._excinfo:
                _audit("conveyor.returned", nodeid, testfunction)

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_logreport(self, report, _audit=audit, _getattr=getattr, _str=str):
            xfail = _getattr(report, "wasxfail", None) is not None
            _audit("conveyor.phase", _str(report.nodeid), _str(report.when), _str(report.outcome), xfail)

        @pytest.hookimpl(trylast=True)
        def pytest_sessionfinish(self, session):
            plugins = session.config.pluginmanager.get_plugins()
            self.added = tuple(repr(p)[:200] for p in plugins
                               if id(p) not in (self.plugins or set()) and not _trusted_module(p))

    return Guard


def main():
    key = _read_key()
    nondumpable = _make_nondumpable()
    workspace, node_ids = os.path.realpath(sys.argv[1]), sys.argv[2:]
    os.chdir(workspace)
    import pytest
    import _pytest.config
    import _pytest.unittest
    import logging  # noqa: F401  (armed before any test code: trusted)
    import unittest  # noqa: F401
    for name in (*_pytest.config.default_plugins, *_pytest.config.builtin_plugins):
        if name not in ("pytester", "cacheprovider", "pastebin"):
            __import__(name if "." in name or name == "pytest" else f"_pytest.{name}")
    texts, graded = _read_sources(workspace, node_ids)
    hashes = _expected_hashes()
    problems = [*_changed_files(workspace, hashes, texts)] + ([] if nondumpable else ["the runner stayed dumpable"])
    here = os.path.dirname(os.path.abspath(__file__))
    trusted_dirs = tuple(os.path.realpath(p) + "/" for p in [*sys.path, here] if p and os.path.isdir(p))
    hook, accept, protect_module, signal_guard = _make_hook(key, 3, texts, graded, trusted_dirs, workspace,
                                                            _repository_hashes(here))
    guard_class = _make_guard(pytest, sys.audit, _pytest.unittest.TestCaseFunction)
    accept(guard_class.pytest_pyfunc_call.__code__, guard_class.pytest_runtest_call.__code__,
           guard_class.pytest_runtest_logreport.__code__, main.__code__)
    for name, module in list(sys.modules.items()):
        if name.startswith(_PROTECTED_PREFIXES):
            protect_module(module)
    sys.modules["_signal"].signal = signal_guard(sys.modules["_signal"].signal)
    audit = sys.audit
    sys.addaudithook(hook)
    del key, hook
    guard = guard_class()
    args = ["-c", os.path.join(here, "pytest.ini"), "--rootdir", workspace, "--confcutdir", workspace,
            "--assert=plain", "-p", "no:cacheprovider", "-p", "no:pytester", "-p", "no:pastebin",
            "-rA", "--tb=short", "-q", *node_ids]
    sys.path.append(workspace)
    status = int(pytest.main(args, plugins=[guard]))
    problems += [f"{name} changed during the run" for name in _changed_files(workspace, hashes)]
    sys.stdout.flush()
    audit("conveyor.finish", status, guard.added, tuple(problems))
    os._exit(status)


if __name__ == "__main__":
    main()
