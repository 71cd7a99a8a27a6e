"""One value of the layout and one place that finishes a parallel model, checked on the source
(no processes): ``ParallelSizes`` is defined once, ``NxDModelState`` is built in
``model_setup/finish.py`` only and nothing else assigns ``.nxd`` or its fields; the nnScaler
front end runs the setup sequence's step 0; only ``backend/`` imports ``torch.distributed``
among the packages checked here."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "nxd_hf"


def _trees():
    for path in sorted(ROOT.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())


def test_one_definition_of_the_layout_value():
    found = [where for where, tree in _trees() for node in ast.walk(tree)
             if isinstance(node, ast.ClassDef) and node.name == "ParallelSizes"]
    assert found == ["parallel_sizes.py"]


def test_one_constructor_of_the_model_state_and_no_scattered_writes():
    calls, writes = [], []
    for where, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "NxDModelState":
                calls.append(where)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for part in ast.walk(target):  # x.nxd = ... and x.nxd.field = ...
                    if isinstance(part, ast.Attribute) and part.attr == "nxd":
                        writes.append(f"{where}:{node.lineno}")
    assert calls == ["model_setup/finish.py"]
    assert [w for w in writes if not w.startswith("model_setup/finish.py:")] == []


def test_nnscaler_runs_the_setup_steps_and_parity_talks_through_the_backend():
    imports = {}
    for where, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                imports.setdefault(where, set()).add(node.module)
            elif isinstance(node, ast.Import):
                imports.setdefault(where, set()).update(a.name for a in node.names)
    assert "nxd_hf.setup_steps" in imports["nnscaler/build.py"]
    assert not any(m.startswith("torch.distributed") for w, ms in imports.items() if w.startswith("parity/")
                   for m in ms)
