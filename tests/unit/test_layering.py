"""The import layering of ../shared/STYLE.md: every import inside nxd_hf/ (lazy ones in functions
included) goes to a lower layer or stays inside its own package, and no imports form a circle.
``checkpoint/`` sits below ``tp/``, ``optim/`` and the pipeline: it writes what the others
describe through the sharding metadata and never imports them, so ``optim/`` may call it."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Lowest first. A module is placed by its longest matching prefix.
LAYERS = [
    ["nxd_hf.backend", "nxd_hf.utils"],
    ["nxd_hf.parallel_sizes"],  # the one value of the layout (pure)
    ["nxd_hf.parallel_state"],
    ["nxd_hf.guards"],  # setup guards: every rank raises the same ValueError (fail_together, input check)
    ["nxd_hf.parallel_layers"],
    ["nxd_hf.modules", "nxd_hf.model_state"],  # model.nxd: read by checkpoint/ and everything above
    ["nxd_hf.moe"],  # mixture-of-experts math and wrappers (TP experts, EP dispatch, aux loss across stages/replicas)
    ["nxd_hf.checkpoint"],
    ["nxd_hf.tp", "nxd_hf.optim", "nxd_hf.model_setup", "nxd_hf.context"],  # context: sequence split, CP attention
    ["nxd_hf.lora", "nxd_hf.pipeline", "nxd_hf.fsdp"],  # fsdp: ZeRO-2/3 on FSDP2 over the DP group
    ["nxd_hf.fx_tp"],  # any module's TP layout from its traced graph (the pipeline's untraced calls); nnscaler, trainer
    ["nxd_hf.architectures"],  # the one module that imports the bundled model_patches
    ["nxd_hf.plan"],  # the layout search: reads plans and sharding arithmetic; the trainer's "auto" sizes use it
    ["nxd_hf.setup_steps"],  # parallelize's steps 0-3b (groups, patch, head layout, layer swap, expert split)
    ["nxd_hf.parallelize"],
    ["nxd_hf.pretrained", "nxd_hf.trainer"],
    ["nxd_hf.integrations", "nxd_hf.lightning"],  # TRL on NxDTrainer; Lightning on the training API
    ["nxd_hf.nnscaler"],  # nnScaler's parallelize/ParallelModule on parallelize, pipeline, tp, optim
    ["nxd_hf.testing"],  # the spawn helper
    ["nxd_hf.parity"],  # check_parity and its cases (the package root re-exports check_parity lazily)
    ["nxd_hf", "nxd_hf.cli"],  # the command's subcommands import what they run when they run
    ["nxd_hf.__main__"],
]
PATCHES = "nxd_hf.model_patches"  # beside the stack: imports nxd_hf.tp and below; imported by nxd_hf.architectures only


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    files = list((ROOT / "nxd_hf").rglob("*.py"))
    return {_module_name(f): f for f in files}


def _imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports anywhere in its body."""
    found = set()
    tree = ast.parse(path.read_text())
    annotations_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                        for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in annotations_only:  # ``if TYPE_CHECKING:`` imports never run: annotations may name upper layers
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def _is_type_checking(node) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _layer(module: str) -> int:
    best, layer = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, layer = len(prefix), index
    assert layer is not None, f"{module} has no layer: place it in LAYERS in tests/unit/test_layering.py"
    return layer


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "nxd_hf" else parts[0]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _allowed(src: str, dst: str) -> bool:
    if _package(src) == _package(dst) and src != "nxd_hf":
        return True
    if _within(dst, PATCHES):
        return src == "nxd_hf.architectures"
    if _within(src, PATCHES):
        return _layer(dst) <= _layer("nxd_hf.tp")
    return _layer(dst) < _layer(src)


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, set(modules)) - {name} for name, path in modules.items()}


def test_every_module_has_a_layer():
    for module in _modules():
        if not _within(module, PATCHES):
            _layer(module)


def test_no_upward_import():
    wrong = [f"{src} imports {dst}" for src, targets in _graph().items() for dst in sorted(targets)
             if not _allowed(src, dst)]
    assert not wrong, "\n".join(wrong)


def test_no_import_circle():
    graph = _graph()
    state, stack, circles = {}, [], []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for dst in sorted(graph.get(module, ())):
            if state.get(dst) == "open":
                circles.append(" -> ".join(stack[stack.index(dst):] + [dst]))
            elif dst not in state:
                visit(dst)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not circles, "\n".join(circles)


def test_the_checker_catches_an_upward_import():
    assert not _allowed("nxd_hf.parallel_layers.grads", "nxd_hf.optim.mixed_precision")
    assert not _allowed("nxd_hf.tp.plan", PATCHES)
    assert _allowed("nxd_hf.optim.zero1.checkpoint", "nxd_hf.checkpoint.save")
    assert _allowed("nxd_hf.model_patches.llama", "nxd_hf.tp.plan")
