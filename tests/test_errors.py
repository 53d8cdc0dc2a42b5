"""One error family: every deliberate error orchestra raises is an `OrchestraError`.

- A source scan (ast) fails on any builtin exception raised (or built to be raised) in library
  code, outside a short allow-list of internal invariants.
- Every exception class defined in the package derives from `OrchestraError`; the classes with a
  builtin second base keep it (``except ValueError`` still works); all survive pickling.
- Every public raise site of `schedule`, `Plan` / `StreamSpec` / `PlanBuilder`, plan JSON,
  `compiler.args` and `compiler.launch` is called: class, both bases and the message.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import json
import pickle
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import orchestra
import orchestra.errors as oe
from orchestra.compiler.args import ArgLayout
from orchestra.compiler.launch import LaunchConfig, check_launch, normalize_dims
from orchestra.compiler.params import Param
from orchestra.errors import (
    KernelArgumentError,
    KernelArgumentTypeError,
    KernelArgumentValueError,
    LaunchConfigError,
    LaunchConfigTypeError,
    LaunchConfigValueError,
    NotFoundError,
    OrchestraError,
    ParameterIndexError,
    PlanError,
    PlanFormatError,
    ScheduleError,
    UnknownParameterError,
)
from orchestra.graph import Alloc, Buffer, Free, TaskGraph
from orchestra.schedule import Plan, PlanBuilder, schedule
from orchestra.schedule.plan import RecordEvent, RunNode, StreamSpec, WaitEvent

PACKAGE = Path(orchestra.__file__).parent

# -- the source scan --------------------------------------------------------------------------

_BUILTIN_EXCEPTIONS = {name for name, obj in vars(builtins).items()
                       if isinstance(obj, type) and issubclass(obj, BaseException)}

# (file relative to the package, enclosing function, builtin): each is an internal invariant, not
# a mistake a caller can make, so it stays a builtin on purpose.
ALLOWED = {
    # abstract method: every node kind overrides accesses()
    ("graph/nodes.py", "Node.accesses", "NotImplementedError"),
    # unreachable: the loop returns at its last unit
    ("cli/cache_cmd.py", "human_bytes", "AssertionError"),
    # the module __getattr__ protocol: hasattr() and getattr(..., default) need AttributeError
    ("compiler/__init__.py", "__getattr__", "AttributeError"),
    # the same protocol on the driver API object (a name cuda-bindings does not have)
    ("driver/api.py", "DriverAPI.__getattr__", "AttributeError"),
    ("serve/__init__.py", "__getattr__", "AttributeError"),
    # cache keys are built from orchestra's own values (str, bytes, ints, tuples of those)
    ("compiler/cache.py", "make_key.feed", "TypeError"),
    # recorded, never raised: a driver callback with a token orchestra never issued
    ("execute/hostfunc.py", "HostCallbacks.__init__.trampoline", "RuntimeError"),
}


def _builtin_raises():
    """(file, function, builtin, line) for every builtin exception raised, or constructed, in
    the package; ``raise type(exc)(...)`` (which can re-raise a builtin) counts as well."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))

        def visit(node, scope):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, scope + [child.name])
                    continue
                where = ".".join(scope)
                if isinstance(child, ast.Raise) and child.exc is not None:
                    exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                    if isinstance(exc, ast.Name) and exc.id in _BUILTIN_EXCEPTIONS:
                        found.append((rel, where, exc.id, child.lineno))
                    if isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name) \
                            and exc.func.id == "type":
                        found.append((rel, where, "type(...)(...)", child.lineno))
                elif isinstance(child, ast.Call) and isinstance(child.func, ast.Name) \
                        and child.func.id in _BUILTIN_EXCEPTIONS:
                    found.append((rel, where, child.func.id, child.lineno))
                visit(child, scope)

        visit(tree, [])
    # a Raise's own Call is seen twice (as the Raise and as a Call): keep one per line
    return sorted(set(found))


def test_library_code_raises_no_builtin_exception():
    offending = [f"orchestra/{f}:{line} in {fn or '<module>'}: {name}"
                 for f, fn, name, line in _builtin_raises() if (f, fn, name) not in ALLOWED]
    assert not offending, (
        "raise an OrchestraError subclass (orchestra/errors.py, docs/errors.md) instead:\n"
        + "\n".join(offending))


def test_the_allow_list_is_not_stale():
    present = {(f, fn, name) for f, fn, name, _ in _builtin_raises()}
    assert ALLOWED <= present, sorted(ALLOWED - present)


def test_the_scan_finds_what_it_must(tmp_path, monkeypatch):
    # The scan itself can fail: a raise, a returned instance and a type(exc) re-raise are found.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "def f(x):\n"
        "    if x:\n"
        "        raise ValueError('x')\n"
        "    return TypeError('y')\n"
        "def g(exc):\n"
        "    raise type(exc)('z') from exc\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    assert [(f, fn, n) for f, fn, n, _ in _builtin_raises()] == [
        ("m.py", "f", "TypeError"), ("m.py", "f", "ValueError"), ("m.py", "g", "type(...)(...)")]


# -- the classes ------------------------------------------------------------------------------


def _package_exception_classes():
    """Every exception class defined in the package's modules (imported by name)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        modname = ".".join(rel.parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
        if not names:
            continue
        mod = importlib.import_module(modname)
        for name in names:
            obj = getattr(mod, name)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                out[f"{modname}.{name}"] = obj
    return out


def test_every_exception_class_of_the_package_is_an_orchestra_error():
    classes = _package_exception_classes()
    assert len(classes) > 40  # the scan found the family
    strays = [name for name, cls in classes.items() if not issubclass(cls, OrchestraError)]
    assert not strays


def _expected_bases():
    """Class -> the builtin it must also be, read from docs/errors.md's table."""
    doc = (PACKAGE.parent / "docs" / "errors.md").read_text(encoding="utf-8")
    section = doc.split("\n## The error family\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, re.M)
    return {name: re.findall(r"`(\w+)`", bases) for name, bases in rows}


def test_the_documented_table_matches_the_classes():
    classes = {cls.__name__: cls for cls in _package_exception_classes().values()}
    documented = _expected_bases()
    assert set(documented) == set(classes), (sorted(set(classes) - set(documented)),
                                             sorted(set(documented) - set(classes)))
    for name, bases in documented.items():
        cls = classes[name]
        assert [b.__name__ for b in cls.__bases__] == bases, name


@pytest.mark.parametrize("cls,builtin", [
    (oe.ClosedError, ValueError), (oe.NotReadyError, ValueError),
    (oe.CallOrderError, RuntimeError), (oe.ScheduleError, ValueError),
    (oe.PlanError, ValueError), (oe.PlanFormatError, ValueError),
    (oe.NodeFieldTypeError, TypeError), (oe.NodeFieldValueError, ValueError),
    (oe.KernelArgumentTypeError, TypeError), (oe.KernelArgumentValueError, ValueError),
    (oe.UnknownParameterError, KeyError), (oe.ParameterIndexError, IndexError),
    (oe.ParamDeclarationTypeError, TypeError), (oe.ParamDeclarationValueError, ValueError),
    (oe.LaunchConfigTypeError, TypeError), (oe.LaunchConfigValueError, ValueError),
    (oe.DriverArgumentTypeError, TypeError), (oe.DriverArgumentValueError, ValueError),
    (oe.PageableMemoryError, TypeError), (oe.CompilerArgumentTypeError, TypeError),
    (oe.CompilerArgumentValueError, ValueError), (oe.KernelSourceNotFoundError, FileNotFoundError),
    (oe.TraceTypeError, TypeError), (oe.TraceValueError, ValueError),
    (oe.MissingExtraError, ImportError), (oe.JobConfigError, ValueError),
    (oe.JobConfigTypeError, TypeError),
    (oe.JobInputError, ValueError), (oe.BenchConfigError, ValueError),
    (oe.UnsupportedDeviceError, RuntimeError), (oe.PrebuiltCubinError, RuntimeError),
    (oe.NotFoundError, KeyError), (oe.CudaForkError, RuntimeError),
])
def test_plain_message_classes_keep_their_builtin_and_pickle(cls, builtin):
    if cls is oe.CudaForkError:
        err = cls("cuStreamCreate", 3, "CUDA_ERROR_NOT_INITIALIZED")
    else:
        err = cls("what to change")
    assert isinstance(err, OrchestraError) and isinstance(err, builtin)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and str(back) == str(err)
    with pytest.raises(builtin):  # an existing `except builtin:` still catches it
        raise err


def test_not_found_errors_print_plainly():
    # KeyError quotes its message (str(KeyError('a b')) == "'a b'"); the family does not.
    assert str(NotFoundError("no stream named 'x' in the plan")) == \
        "no stream named 'x' in the plan"
    assert str(UnknownParameterError("kernel k(int n) has no parameter 'm'")) == \
        "kernel k(int n) has no parameter 'm'"


def test_root_classes_catch_both_kinds():
    assert issubclass(KernelArgumentTypeError, KernelArgumentError)
    assert issubclass(KernelArgumentValueError, KernelArgumentError)
    assert issubclass(UnknownParameterError, KernelArgumentError)
    assert issubclass(LaunchConfigTypeError, LaunchConfigError)
    assert not issubclass(LaunchConfigTypeError, ValueError)  # a root never mixes the builtins
    assert not issubclass(KernelArgumentValueError, TypeError)


def test_the_package_exports_the_family():
    for name in ("OrchestraError", "PlanError", "ScheduleError", "NodeFieldError",
                 "KernelArgumentError", "LaunchConfigError", "DriverTooOldError",
                 "DriverBindingError", "CudaForkError"):
        assert getattr(orchestra, name) is getattr(oe, name)


# -- schedule() and the plan classes ------------------------------------------------------------


def _raises(cls, builtin, message, fn, *args, **kwargs):
    """Call ``fn``; it must raise exactly ``cls``, an OrchestraError and a ``builtin``, whose
    str() is ``message`` (a str: equal; a compiled regex: full match)."""
    with pytest.raises(cls) as info:
        fn(*args, **kwargs)
    err = info.value
    assert type(err) is cls
    assert isinstance(err, OrchestraError) and isinstance(err, builtin)
    text = str(err)
    if isinstance(message, re.Pattern):
        assert message.fullmatch(text), text
    else:
        assert text == message
    return err


def _tiny_graph():
    g = TaskGraph()
    b = Buffer("x", 64)
    g.add(Alloc("a", b))
    g.add(Free("f", b))
    return g


@pytest.mark.parametrize("streams", [0, -1])
def test_schedule_refuses_a_bad_stream_count(streams):
    _raises(ScheduleError, ValueError, f"streams must be an int >= 1; got {streams!r}",
            schedule, _tiny_graph(), streams=streams)


@pytest.mark.parametrize("streams", [True, 2.0, "3", None])
def test_a_stream_count_of_the_wrong_type_is_a_type_error_too(streams):
    from orchestra.errors import ScheduleArgumentTypeError

    with pytest.raises(ScheduleArgumentTypeError) as info:
        schedule(_tiny_graph(), streams=streams)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ScheduleError)
    assert str(info.value) == f"streams must be an int >= 1; got {streams!r}"


def test_schedule_takes_a_numpy_stream_count():
    import numpy as np

    # np.int64(2) was refused: "streams must be an int >= 1; got np.int64(2)"
    for policy in ("round-robin", "by-engine", "critical-path", "concurrent"):
        assert schedule(_tiny_graph(), policy, np.int64(2)) == schedule(_tiny_graph(), policy, 2)
    with pytest.raises(ScheduleError, match=r"got -1\.000e\+5000 \(a 16610-bit int\)"):
        schedule(_tiny_graph(), streams=-10**5000)  # repr() of it raises


def test_schedule_refuses_an_unknown_policy():
    _raises(ScheduleError, ValueError,
            "unknown policy 'fastest'; choose one of round-robin, by-engine, critical-path, "
            "concurrent",
            schedule, _tiny_graph(), policy="fastest")


def test_schedule_refuses_a_negative_cost():
    _raises(ScheduleError, ValueError, "cost of node a must be a finite number >= 0 µs; got -1.0",
            schedule, _tiny_graph(), policy="critical-path", costs={"a": -1, "f": 1})


def test_stream_spec_refuses_an_unknown_role():
    _raises(PlanError, ValueError,
            "stream s: role must be one of ('upload', 'compute', 'download', 'general'); "
            "got 'gpu'", StreamSpec, "s", role="gpu")


def test_plan_refuses_duplicate_and_unknown_streams_and_non_steps():
    _raises(PlanError, ValueError, "plan streams must have distinct names; got ['a', 'a']",
            Plan, [StreamSpec("a"), StreamSpec("a")], {})
    _raises(PlanError, ValueError, "plan steps name unknown stream(s) ['b']; streams: ['a']",
            Plan, [StreamSpec("a")], {"b": [RunNode("x")]})
    _raises(PlanError, ValueError,
            "stream a: a step must be RunNode, RecordEvent or WaitEvent; got 'run x'",
            Plan, [StreamSpec("a")], {"a": ["run x"]})


def test_plan_lookups_are_not_found_errors():
    plan = schedule(_tiny_graph(), streams=1)
    _raises(NotFoundError, KeyError, "no stream named 'zz' in the plan", plan.stream, "zz")
    _raises(NotFoundError, KeyError, "the plan does not run a node named 'zz'",
            plan.stream_of, "zz")
    assert plan.stream_of("a") == plan.streams[0].name  # the success path is unchanged


def test_issue_order_refuses_waits_that_form_a_cycle():
    plan = Plan([StreamSpec("a"), StreamSpec("b")],
                {"a": [WaitEvent("eb"), RunNode("x"), RecordEvent("ea")],
                 "b": [WaitEvent("ea"), RunNode("y"), RecordEvent("eb")]})
    _raises(PlanError, ValueError,
            "plan cannot be issued: waits form a cycle (a waits for eb; b waits for ea)",
            plan.issue_order)


def test_plan_builder_needs_a_stream_first():
    _raises(PlanError, ValueError, "PlanBuilder: call .stream(name) before adding steps",
            PlanBuilder().run, "x")


# -- plan JSON --------------------------------------------------------------------------------


def _good():
    return {"format": "orchestra.plan/1", "policy": "manual", "order": ["x"], "meta": {},
            "streams": [{"name": "s0", "priority": 0, "role": "general",
                         "steps": [["run", "x"], ["record", "e"]]},
                        {"name": "s1", "steps": [["wait", "e"]]}]}


def _without(d, *path):
    d = json.loads(json.dumps(d))
    cur = d
    for p in path[:-1]:
        cur = cur[p]
    del cur[path[-1]]
    return d


def _with(d, value, *path):
    d = json.loads(json.dumps(d))
    cur = d
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return d


def test_good_plan_json_round_trips():
    plan = Plan.from_json(json.dumps(_good()))
    assert plan.stream_names == ("s0", "s1") and plan.order == ("x",)
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("doc,message,path", [
    (_without(_good(), "streams", 1, "steps"), 'plan JSON: streams[1]: missing "steps"',
     "streams[1].steps"),
    (_without(_good(), "streams", 0, "name"), 'plan JSON: streams[0]: missing "name"',
     "streams[0].name"),
    (_without(_good(), "streams"), 'plan JSON: missing "streams"', "streams"),
    (_without(_good(), "format"),
     "plan JSON: missing \"format\" (want 'orchestra.plan/1'): not an orchestra plan", "format"),
    (_with(_good(), "orchestra.plan/0", "format"),
     "plan JSON: not an orchestra plan (format 'orchestra.plan/0', want 'orchestra.plan/1')",
     "format"),
    ([_good()], "plan JSON: expected an object, got list [" + repr(_good())[:0], ""),
    (_with(_good(), {"name": "s0"}, "streams"),
     "plan JSON: streams must be a list, got dict {'name': 's0'}", "streams"),
    (_with(_good(), "s0", "streams", 0), "plan JSON: streams[0]: expected an object, got str 's0'",
     "streams[0]"),
    (_with(_good(), 7, "streams", 1, "name"),
     "plan JSON: streams[1].name must be a string, got int 7", "streams[1].name"),
    (_with(_good(), "high", "streams", 0, "priority"),
     "plan JSON: streams[0].priority must be an int, got str 'high'", "streams[0].priority"),
    (_with(_good(), "gpu", "streams", 0, "role"),
     "plan JSON: streams[0]: stream s0: role must be one of ('upload', 'compute', 'download',"
     " 'general'); got 'gpu'", "streams[0]"),
    (_with(_good(), "run x", "streams", 0, "steps"),
     "plan JSON: streams[0].steps must be a list, got str 'run x'", "streams[0].steps"),
    (_with(_good(), ["run"], "streams", 0, "steps", 0),
     'plan JSON: streams[0].steps[0] must be a [kind, name] pair such as ["run", "b0.h2d"],'
     " got list ['run']", "streams[0].steps[0]"),
    (_with(_good(), ["launch", "x"], "streams", 0, "steps", 1),
     "plan JSON: streams[0].steps[1]: unknown step kind 'launch'; kinds: run, record, wait",
     "streams[0].steps[1]"),
    (_with(_good(), ["run", 3], "streams", 0, "steps", 0),
     "plan JSON: streams[0].steps[0][1] must be a string, got int 3", "streams[0].steps[0][1]"),
    (_with(_good(), "s0", "streams", 1, "name"),
     "plan JSON: streams[1]: a second stream named 's0'", "streams[1].name"),
    (_with(_good(), "x", "order"), "plan JSON: order must be a list, got str 'x'", "order"),
    (_with(_good(), [1], "order"), "plan JSON: order[0] must be a string, got int 1", "order[0]"),
    (_with(_good(), [], "meta"), "plan JSON: meta: expected an object, got list []", "meta"),
    (_with(_good(), 3, "policy"), "plan JSON: policy must be a string, got int 3", "policy"),
])
def test_malformed_plan_json_names_what_and_where(doc, message, path):
    if isinstance(doc, list):
        message = f"plan JSON: expected an object, got list {doc!r}"
    err = _raises(PlanFormatError, ValueError, message, Plan.from_json, json.dumps(doc))
    assert isinstance(err, PlanError) and err.path == path
    err2 = pickle.loads(pickle.dumps(err))
    assert err2.path == path and str(err2) == message


def test_text_that_is_not_json():
    text = '{"format": "orchestra.plan/1" "streams": []}'
    with pytest.raises(json.JSONDecodeError) as decode:
        json.loads(text)
    err = _raises(PlanFormatError, ValueError, f"plan JSON: not valid JSON: {decode.value}",
                  Plan.from_json, text)
    assert err.path == "" and "line 1 column 31" in str(err)


# -- compiler.args: every converter and lookup ---------------------------------------------------


def _layout(*decls):
    return ArgLayout([Param(name, ctype, kind, False) for name, ctype, kind in decls], "k")


PTR = _layout(("p", "float*", "pointer"))
INT = _layout(("n", "int", "scalar"))
U8 = _layout(("b", "unsigned char", "scalar"))
BOOL = _layout(("flag", "bool", "scalar"))
F32 = _layout(("s", "float", "scalar"))
F64 = _layout(("d", "double", "scalar"))


class _NotAnAddress:
    ptr = "0x10"


@pytest.mark.parametrize("layout,value,cls,builtin,message", [
    (PTR, 1 << 64, KernelArgumentValueError, ValueError,
     "parameter p (float*): address 18446744073709551616 is not a 64-bit unsigned value (0 to"
     " 18446744073709551615)"),
    (PTR, 1.5, KernelArgumentTypeError, TypeError,
     "parameter p (float*) needs device memory: pass a DeviceBuffer (anything with .ptr), a"
     " CUdeviceptr, an int address or None; got float 1.5"),
    (PTR, _NotAnAddress(), KernelArgumentTypeError, TypeError,
     re.compile(r"parameter p \(float\*\): .*_NotAnAddress.*\.ptr is not an address")),
    (PTR, np.zeros(4, np.float32), KernelArgumentTypeError, TypeError,
     "parameter p (float*) needs device memory: got a numpy array (host memory); copy it into"
     " a DeviceBuffer and pass that"),
    (PTR, "0x10", KernelArgumentTypeError, TypeError,
     "parameter p (float*) needs device memory: pass a DeviceBuffer (anything with .ptr), a"
     " CUdeviceptr, an int address or None; got str"),
    (BOOL, 1, KernelArgumentTypeError, TypeError,
     "parameter flag (bool): expected a bool (True/False), got int 1"),
    (INT, True, KernelArgumentTypeError, TypeError,
     "parameter n (int): got a bool where an integer is declared; pass an int (bool is accepted"
     " only for bool parameters)"),
    (INT, 3.0, KernelArgumentTypeError, TypeError,
     "parameter n (int): got a float (3.0) where an integer is declared; pass an int"),
    (INT, np.int64(3), KernelArgumentTypeError, TypeError,
     "parameter n (int): numpy int64 scalar does not match the declared int32; pass"
     " numpy.int32(...) or a Python int"),
    (INT, "3", KernelArgumentTypeError, TypeError,
     "parameter n (int): expected an int, got str"),
    (INT, 1 << 31, KernelArgumentValueError, ValueError,
     "parameter n (int): 2147483648 does not fit in int32: pass an int from -2147483648 to"
     " 2147483647"),
    (U8, -1, KernelArgumentValueError, ValueError,
     "parameter b (unsigned char): -1 does not fit in uint8: pass an int from 0 to 255"),
    (F32, True, KernelArgumentTypeError, TypeError,
     "parameter s (float): got a bool where a floating-point value is declared"),
    (F32, np.float64(0.5), KernelArgumentTypeError, TypeError,
     "parameter s (float): numpy float64 scalar does not match the declared float32; pass"
     " numpy.float32(...) or a Python float"),
    (F32, "0.5", KernelArgumentTypeError, TypeError,
     "parameter s (float): expected a float, got str"),
    (F32, 1e39, KernelArgumentValueError, ValueError,
     "parameter s (float): 1e+39 does not fit in float32: pass a value from -3.4028235e+38 to"
     " 3.4028235e+38 (nan and +-inf pass as they are)"),
    (F32, (1 << 24) + 1, KernelArgumentValueError, ValueError,
     "parameter s (float): the int 16777217 is not exactly representable in float32; pass a"
     " float if rounding is intended"),
    (F64, (1 << 53) + 1, KernelArgumentValueError, ValueError,
     "parameter d (double): the int 9007199254740993 is not exactly representable in float64;"
     " pass a float if rounding is intended"),
])
def test_argument_converters(layout, value, cls, builtin, message):
    _raises(cls, builtin, message, layout.pack, [value])


def test_a_buffer_where_a_scalar_belongs():
    buf = SimpleNamespace(ptr=0x1000)
    for layout, label in ((INT, "n (int)"), (BOOL, "flag (bool)"), (F32, "s (float)")):
        _raises(KernelArgumentTypeError, TypeError,
                re.compile(rf"parameter {re.escape(label)}: got a buffer \(.*\) where a scalar"
                           r" belongs"), layout.pack, [buf])


def test_pack_arity_and_mappings():
    two = _layout(("n", "int", "scalar"), ("s", "float", "scalar"))
    _raises(KernelArgumentTypeError, TypeError, "kernel k(int n, float s) takes 2 arguments,"
            " got 1", two.pack, [1])
    _raises(KernelArgumentTypeError, TypeError, "kernel k(int n, float s) has no"
            " parameter(s) ['m']", two.pack, {"n": 1, "s": 1.0, "m": 2})
    _raises(KernelArgumentTypeError, TypeError, "kernel k(int n, float s): missing"
            " argument(s) ['s']", two.pack, {"n": 1})
    _raises(KernelArgumentTypeError, TypeError, "kernel arguments must be a sequence or a"
            " mapping, got int", two.pack, 5)
    assert two.pack({"n": 1, "s": 2.0}).values() == (1, 2.0)  # the success path


def test_parameter_lookups():
    packed = _layout(("n", "int", "scalar"), ("s", "float", "scalar")).pack([1, 2.0])
    _raises(UnknownParameterError, KeyError, "kernel k(int n, float s) has no parameter 'm'",
            packed.set, "m", 3)
    _raises(ParameterIndexError, IndexError,
            "parameter index 2 out of range for k(int n, float s)", packed.set, 2, 3)
    _raises(KernelArgumentTypeError, TypeError,
            "a parameter of k(int n, float s) is named by its name (str) or index (int), got"
            " float 1.0", packed.get, 1.0)
    _raises(KernelArgumentTypeError, TypeError,
            "parameter n (int): got a float (3.5) where an integer is declared; pass an int",
            packed.set, "n", 3.5)
    assert packed.get("n") == 1  # the old value stays after a refused set
    packed.set(-1, 4.0)
    assert packed.get("s") == 4.0


# -- compiler.launch: every check ---------------------------------------------------------------

H200 = SimpleNamespace(
    max_threads_per_block=1024, max_block_dim=(1024, 1024, 64),
    max_grid_dim=(2147483647, 65535, 65535), max_shared_memory_per_block=49152,
    max_shared_memory_per_block_optin=232448, cooperative_launch=True, cluster_launch=True,
    least_stream_priority=0, greatest_stream_priority=-5)
OLD = SimpleNamespace(**{**vars(H200), "cooperative_launch": False, "cluster_launch": False})


@pytest.mark.parametrize("value,cls,builtin,message", [
    ((1, 2, 3, 4), LaunchConfigValueError, ValueError,
     "grid must have 1 to 3 dimensions, got 4: (1, 2, 3, 4)"),
    ((), LaunchConfigValueError, ValueError, "grid must have 1 to 3 dimensions, got 0: ()"),
    (True, LaunchConfigTypeError, TypeError, "grid dimensions must be ints, got True"),
    (1.0, LaunchConfigTypeError, TypeError, "grid dimensions must be ints, got 1.0"),
    ((2, "4"), LaunchConfigTypeError, TypeError, "grid dimensions must be ints, got (2, '4')"),
    (0, LaunchConfigValueError, ValueError,
     "grid dimensions must be between 1 and 2**32-1, got 0"),
    ((1, 1 << 32), LaunchConfigValueError, ValueError,
     "grid dimensions must be between 1 and 2**32-1, got (1, 4294967296)"),
])
def test_normalize_dims(value, cls, builtin, message):
    _raises(cls, builtin, message, normalize_dims, value, "grid")


def test_launch_config_make():
    _raises(LaunchConfigTypeError, TypeError, "shared_mem must be an int (bytes), got 1.5",
            LaunchConfig.make, 1, 1, 1.5)
    _raises(LaunchConfigValueError, ValueError, "shared_mem must be a byte count >= 0, got -1",
            LaunchConfig.make, 1, 1, -1)
    _raises(LaunchConfigValueError, ValueError,
            "shared_mem must be a byte count >= 0, got True", LaunchConfig.make, 1, 1, True)
    _raises(LaunchConfigTypeError, TypeError, "priority must be an int, got True",
            LaunchConfig.make, 1, 1, priority=True)
    _raises(LaunchConfigTypeError, TypeError, "priority must be an int, got -1.0",
            LaunchConfig.make, 1, 1, priority=-1.0)
    _raises(LaunchConfigTypeError, TypeError, "block dimensions must be ints, got 'x'",
            LaunchConfig.make, 1, "x")
    cfg = LaunchConfig.make((2, 2), 64, 16, priority=-1)
    assert (cfg.grid, cfg.block, cfg.shared_mem, cfg.priority) == ((2, 2, 1), (64, 1, 1), 16, -1)


def _check(limits=H200, *, grid=1, block=128, shared_mem=0, attrs=None, **kw):
    cfg = LaunchConfig.make(grid, block, shared_mem, **(attrs or {}))
    return check_launch(cfg, limits, kernel_name="k", **kw)


@pytest.mark.parametrize("kw,message", [
    (dict(block=2048), "launch of k: block (2048, 1, 1) has 2048 threads, above the device's max"
     " threads per block (1024)"),
    (dict(block=(1, 1, 128)), "launch of k: block dimension z = 128 exceeds the device's max"
     " block dims (1024, 1024, 64)"),
    (dict(block=1024, kernel_max_threads=512), "launch of k: block (1024, 1, 1) has 1024 threads,"
     " above the kernel's max threads per block (512, limited by its register use or"
     " __launch_bounds__)"),
    (dict(grid=(1, 65536)), "launch of k: grid dimension y = 65536 exceeds the device's max grid"
     " dims (2147483647, 65535, 65535)"),
    (dict(shared_mem=232449), "launch of k: shared memory per block 232449 bytes dynamic + 0"
     " static = 232449 bytes exceeds the device's opt-in limit (max shared memory per block"
     " optin = 232448 bytes)"),
    (dict(attrs={"pdl": True}, compute_capability=(8, 0)), "launch of k: programmatic dependent"
     " launch (pdl=True) needs compute capability 9.0 or newer; this device is 8.0"),
    (dict(limits=OLD, grid=8, attrs={"cluster": 2}), "launch of k: this device does not support"
     " thread block clusters (cluster launch needs compute capability 9.0+)"),
    (dict(grid=16, attrs={"cluster": 16}), "launch of k: cluster (16, 1, 1) has 16 blocks, above"
     " the max cluster size 8 (portable limit; the kernel does not allow non-portable cluster"
     " sizes)"),
    (dict(grid=9, attrs={"cluster": 2}), "launch of k: cluster dimension x = 2 does not divide"
     " grid dimension x = 9 (cluster dims must divide the grid)"),
    (dict(limits=OLD, attrs={"cooperative": True}), "launch of k: this device does not support"
     " cooperative launch"),
    (dict(grid=1000, attrs={"cooperative": True}, sm_count=132, occupancy=2),
     "launch of k: cooperative grid (1000, 1, 1) has 1000 blocks, but only 264 can be"
     " co-resident (132 SMs x 2 blocks per SM for 128 threads and 0 bytes of shared memory,"
     " cuOccupancyMaxActiveBlocksPerMultiprocessor)"),
    (dict(attrs={"priority": -6}), "launch of k: priority -6 is outside the device's stream"
     " priority range -5 (highest) .. 0 (lowest)"),
    (dict(attrs={"priority": 1}), "launch of k: priority 1 is outside the device's stream"
     " priority range -5 (highest) .. 0 (lowest)"),
])
def test_check_launch(kw, message):
    limits = kw.pop("limits", H200)
    _raises(LaunchConfigValueError, ValueError, message, _check, limits, **kw)


def test_check_launch_success_paths_return_the_opt_in():
    assert _check() == 0
    assert _check(shared_mem=100 * 1024) == 100 * 1024
    assert _check(grid=16, attrs={"cluster": 16}, non_portable_cluster=True) == 0
    assert _check(grid=264, attrs={"cooperative": True}, sm_count=132, occupancy=2) == 0
