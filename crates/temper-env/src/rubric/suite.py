"""Runs a model's tests against code under test and its mutants (temper's
`mutation_score` and `coverage` rubrics). Stdlib only; runs inside the
sandbox, one run per rollout.

Input: one JSON object on stdin (see `suite.rs`). Output: one JSON object
written to `suite_result.json` in the working directory, so nothing the
tested code prints can corrupt it.

Mutants are generated here with the `ast` module, not in Rust: they must be
valid Python with Python's own semantics (operator precedence, slices,
constants), `ast.unparse` gives that for free, and the equivalence filter
has to execute code anyway, which only the sandbox may do.

Every variant (the original and each mutant) runs in a forked child with
stdout and stderr on /dev/null and a wall-clock limit, so a test that
loops, exits or prints only decides its own pass/fail.
"""

import ast
import copy
import json
import os
import select
import signal
import sys
import time
import types

RESULT = "suite_result.json"

# Operator replacements: each site yields one mutant per replacement.
BINOPS = {
    ast.Add: [ast.Sub],
    ast.Sub: [ast.Add],
    ast.Mult: [ast.Div],
    ast.Div: [ast.Mult],
    ast.FloorDiv: [ast.Div],
    ast.Mod: [ast.FloorDiv],
    ast.Pow: [ast.Mult],
    ast.BitAnd: [ast.BitOr],
    ast.BitOr: [ast.BitAnd],
    ast.LShift: [ast.RShift],
    ast.RShift: [ast.LShift],
}
CMPOPS = {
    ast.Lt: [ast.LtE, ast.Gt],
    ast.LtE: [ast.Lt, ast.GtE],
    ast.Gt: [ast.GtE, ast.Lt],
    ast.GtE: [ast.Gt, ast.LtE],
    ast.Eq: [ast.NotEq],
    ast.NotEq: [ast.Eq],
    ast.Is: [ast.IsNot],
    ast.IsNot: [ast.Is],
    ast.In: [ast.NotIn],
    ast.NotIn: [ast.In],
}
KINDS = ["comparison", "arithmetic", "constant", "return", "boolean", "slice"]


def docstrings(tree):
    """Constant nodes that are docstrings (never mutated)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out.add(id(value))
    return out


def sites(tree):
    """(kind, node index in ast.walk order, edit) for every mutation; an
    edit changes the node found at that index in a copy of the tree."""
    skip = docstrings(tree)
    found = []
    for i, node in enumerate(ast.walk(tree)):
        if isinstance(node, (ast.BinOp, ast.AugAssign)):
            for new in BINOPS.get(type(node.op), []):
                found.append(("arithmetic", i, ("op", new)))
        elif isinstance(node, ast.Compare):
            for j, op in enumerate(node.ops):
                for new in CMPOPS.get(type(op), []):
                    found.append(("comparison", i, ("cmp", j, new)))
        elif isinstance(node, ast.BoolOp):
            new = ast.Or if isinstance(node.op, ast.And) else ast.And
            found.append(("boolean", i, ("op", new)))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            found.append(("boolean" if isinstance(node.op, ast.Not) else "arithmetic", i, ("unwrap",)))
        elif isinstance(node, ast.Constant) and id(node) not in skip:
            v = node.value
            if isinstance(v, bool):
                found.append(("constant", i, ("value", not v)))
            elif isinstance(v, (int, float)):
                found.append(("constant", i, ("value", v + 1)))
                found.append(("constant", i, ("value", 0 if v != 0 else -1)))
            elif isinstance(v, str) and v:
                found.append(("constant", i, ("value", "")))
        elif isinstance(node, ast.Slice):
            for part in ("lower", "upper", "step"):
                if getattr(node, part) is not None:
                    found.append(("slice", i, ("drop", part)))
        elif isinstance(node, ast.Return) and node.value is not None:
            if not (isinstance(node.value, ast.Constant) and node.value.value is None):
                found.append(("return", i, ("none",)))
    return found


def apply(tree, index, edit):
    """The source of `tree` with `edit` made at node `index`, or None."""
    tree = copy.deepcopy(tree)
    parents = {}
    target = None
    for i, node in enumerate(ast.walk(tree)):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
        if i == index:
            target = node
            break
    if target is None:
        return None
    kind = edit[0]
    if kind == "op":
        target.op = edit[1]()
    elif kind == "cmp":
        target.ops[edit[1]] = edit[2]()
    elif kind == "value":
        target.value = edit[1]
    elif kind == "drop":
        setattr(target, edit[1], None)
    elif kind == "none":
        target.value = ast.Constant(value=None)
    elif kind == "unwrap":
        # Replace the node by its operand in its parent.
        for node in ast.walk(tree):
            for field, value in ast.iter_fields(node):
                if value is target:
                    setattr(node, field, target.operand)
                elif isinstance(value, list) and any(v is target for v in value):
                    value[[id(v) for v in value].index(id(target))] = target.operand
    try:
        return ast.unparse(ast.fix_missing_locations(tree))
    except Exception:
        return None


def candidates(code):
    """Distinct mutants of `code`, ordered round-robin over mutation kinds
    (and in source order within a kind), so a cap keeps a varied set."""
    tree = ast.parse(code)
    original = ast.unparse(tree)
    by_kind = {k: [] for k in KINDS}
    for kind, index, edit in sites(tree):
        by_kind[kind].append((index, edit))
    ordered, seen = [], {original}
    queues = [list(by_kind[k]) for k in KINDS]
    while any(queues):
        for q in queues:
            if not q:
                continue
            src = apply(tree, *q.pop(0))
            if src is None or src in seen:
                continue
            try:
                compile(src, "<mutant>", "exec")
            except SyntaxError:
                continue
            seen.add(src)
            ordered.append(src)
    return ordered


def run_child(fn, timeout):
    """fn() in a forked child with stdout/stderr on /dev/null; its
    JSON-able result, or None when it crashed, exited or timed out."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            out = json.dumps({"value": fn()}).encode()
            # Our own copy of the pipe: tests may close or dup fds.
            while out:
                out = out[os.write(w, out):]
        except BaseException:
            code = 1
        os._exit(code)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([r], [], [], left)
        if not ready:
            break
        data = os.read(r, 65536)
        if not data:
            break
        chunks.append(data)
    os.close(r)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
    try:
        return json.loads(b"".join(chunks))["value"]
    except (ValueError, KeyError):
        return None


def load(src, module, workdir):
    """`src` imported as module `module` (file on disk for tracebacks)."""
    path = os.path.join(workdir, module + ".py")
    with open(path, "w") as f:
        f.write(src)
    mod = types.ModuleType(module)
    mod.__file__ = path
    sys.modules[module] = mod
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod, path


def run_tests(mod, tests, module, workdir, runner):
    """True when every test passes: top-level asserts run, then every
    `test_*` function is called (runner `assert`), or pytest runs the file
    (runner `pytest`)."""
    if runner == "pytest":
        import pytest

        path = os.path.join(workdir, "test_" + module + ".py")
        with open(path, "w") as f:
            f.write("from %s import *\n%s\n" % (module, tests))
        return pytest.main(["-q", "-x", "-p", "no:cacheprovider", path]) == 0
    ns = dict(mod.__dict__)
    ns["__name__"] = "test_" + module
    exec(compile(tests, os.path.join(workdir, "test_" + module + ".py"), "exec"), ns)
    for name, fn in list(ns.items()):
        if name.startswith("test") and callable(fn) and getattr(fn, "__module__", None) == ns["__name__"]:
            fn()
    return True


def module_functions(code_obj, path):
    """The code objects of the functions (and classes) defined in `path`."""
    stack = [c for c in code_obj.co_consts if isinstance(c, types.CodeType)]
    while stack:
        co = stack.pop()
        if co.co_filename == path:
            yield co
        stack.extend(c for c in co.co_consts if isinstance(c, types.CodeType))


def executable_lines(code_obj, path):
    """Lines with bytecode in the functions (and classes) of the module."""
    return {l for co in module_functions(code_obj, path) for _, _, l in co.co_lines() if l is not None}


def branch_points(code_obj, path):
    """(code, offset) of every conditional jump in the module's functions."""
    import dis

    return {
        (co, ins.offset)
        for co in module_functions(code_obj, path)
        for ins in dis.get_instructions(co)
        if ins.opname.startswith("POP_JUMP") or ins.opname == "FOR_ITER"
    }


def measured(src, tests, module, workdir, runner):
    """Pass/fail of the tests on `src`, with line (and, where
    sys.monitoring exists, branch) coverage of `src`."""
    path = os.path.join(workdir, module + ".py")
    code_obj = compile(src, path, "exec")
    lines = executable_lines(code_obj, path)
    hits = set()

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != path:
            return None
        hits.add(frame.f_lineno)
        return tracer

    branches, points, mon = set(), None, getattr(sys, "monitoring", None)
    if mon is not None:
        points = branch_points(code_obj, path)
        tool = mon.COVERAGE_ID
        mon.use_tool_id(tool, "temper")

        def on_branch(co, src_off, dst_off):
            if co.co_filename == path:
                branches.add((co, src_off, dst_off))

        events = getattr(mon.events, "BRANCH", 0)
        if not events:
            events = mon.events.BRANCH_LEFT | mon.events.BRANCH_RIGHT
            mon.register_callback(tool, mon.events.BRANCH_LEFT, on_branch)
            mon.register_callback(tool, mon.events.BRANCH_RIGHT, on_branch)
        else:
            mon.register_callback(tool, events, on_branch)
        mon.set_events(tool, events)
    sys.settrace(tracer)
    ok = False
    try:
        mod, _ = load(src, module, workdir)
        ok = run_tests(mod, tests, module, workdir, runner)
    except BaseException:
        ok = False
    finally:
        sys.settrace(None)
        if mon is not None:
            mon.set_events(mon.COVERAGE_ID, 0)
    out = {"ok": ok, "line": len(hits & lines) / len(lines) if lines else 1.0}
    if points is not None:
        out["branch"] = (
            min(1.0, len({b for b in branches if (b[0], b[1]) in points}) / (2 * len(points)))
            if points
            else 1.0
        )
    return out


def passes(src, tests, module, workdir, runner):
    try:
        mod, _ = load(src, module, workdir)
        return run_tests(mod, tests, module, workdir, runner)
    except BaseException:
        return False


def outcomes(src, samples, module, workdir):
    """repr of each sample's value (or the exception type it raised)."""
    mod, _ = load(src, module, workdir)
    out = []
    for s in samples:
        try:
            out.append("=" + repr(eval(s, dict(mod.__dict__))))
        except Exception as e:
            out.append("!" + type(e).__name__)
    return out


def mutants_of(req, workdir):
    """Generated mutants not equivalent to the original on the samples,
    at most `max_mutants`; and how many were dropped as equivalent."""
    code, samples, limit = req["code"], req.get("samples") or [], req["max_mutants"]
    module, timeout = req["module"], req["timeout"]
    all_mutants = candidates(code)
    if not samples:
        return all_mutants[:limit], 0, 0
    want = run_child(lambda: outcomes(code, samples, module, workdir), timeout)
    if want is None:
        raise RuntimeError("the original code fails or hangs on its sample inputs")
    kept, equivalent, hung = [], 0, 0
    for src in all_mutants:
        if len(kept) >= limit:
            break
        got = run_child(lambda: outcomes(src, samples, module, workdir), timeout)
        if got is None:
            # Hangs (or crashes the interpreter) on the samples: every
            # rollout would pay its timeout, so it is not used.
            hung += 1
        elif got == want:
            equivalent += 1
        else:
            kept.append(src)
    return kept, equivalent, hung


def main():
    req = json.loads(sys.stdin.read())
    workdir = os.path.join(os.getcwd(), "suite")
    os.makedirs(workdir, exist_ok=True)
    sys.path.insert(0, workdir)
    if req.get("runner") == "pytest":
        import pytest  # noqa: F401  (imported once, before the forks)
    module, tests, timeout, runner = req["module"], req["tests"], req["timeout"], req.get("runner", "assert")
    out = {}
    try:
        if req["mode"] in ("mutation", "generate"):
            if req.get("mutants") is not None:
                mutants, equivalent, hung = req["mutants"], 0, 0
            else:
                mutants, equivalent, hung = mutants_of(req, workdir)
            out.update(mutant_sources=mutants, equivalent=equivalent, hung=hung)
        if req["mode"] == "coverage":
            m = run_child(lambda: measured(req["code"], tests, module, workdir, runner), timeout)
            m = m or {"ok": False, "line": 0.0}
            out.update(pass_original=m["ok"], line=m["line"])
            if "branch" in m:
                out["branch"] = m["branch"]
        elif req["mode"] == "mutation":
            ok = run_child(lambda: passes(req["code"], tests, module, workdir, runner), timeout)
            killed = 0
            if ok:
                for src in mutants:
                    survived = run_child(lambda: passes(src, tests, module, workdir, runner), timeout)
                    killed += int(not survived)
            out.update(pass_original=bool(ok), killed=killed, mutants=len(mutants))
    except Exception as e:
        out["error"] = "%s: %s" % (type(e).__name__, e)
    with open(os.path.join(os.path.dirname(workdir), RESULT), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
