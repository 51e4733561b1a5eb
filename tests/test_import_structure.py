"""The import graph of tandem/, services/ and bench/: no loop, nothing imported up the stack.

Read from the source with `ast`, so no module runs. A module-level import is one that runs when
the module is imported (class bodies and `try` blocks included; `if TYPE_CHECKING:` blocks
excluded); a function-level import runs when its function is called. A loop closed by an import
inside a function says a module holds two things: move the shared piece below both instead.
A function-level import of a project module is allowed only for the reasons listed in
`FUNCTION_LEVEL`.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("tandem", "services", "bench")

# Function-level imports of project modules, by importing module: the modules it may import
# inside a function, and why they are not imported at the top.
FUNCTION_LEVEL: dict[str, tuple[tuple[str, ...], str]] = {
    "tandem.chat": (
        ("tandem.credentials", "tandem.rpc.api_pb2", "tandem.rpc.api_pb2_grpc"),
        "`tandem chat` subcommand: gRPC stubs loaded when it runs",
    ),
    "tandem.cli": (
        ("tandem.quant.cli",),
        "`tandem quantize`: the offline tool, above the model, loaded on demand",
    ),
    "tandem.llm": (
        ("tandem.engine.proposers", "tandem.engine.speculator"),
        "speculation loaded only when a proposer is asked for",
    ),
    "tandem.metrics": (
        ("tandem.nvml",),
        "NVML only where a GPU gauge is read",
    ),
    "tandem.up": (
        ("tandem.stage_certs",),
        "stage_certs needs cryptography, optional: loaded for --stage-mtls auto only",
    ),
    "tandem.engine.proposers": (
        ("tandem.engine.draft_models",),
        "a draft model (torch, weights) only for the model proposers",
    ),
    "tandem.kv.transports": (
        (
            "tandem.kv.transports.cuda_ipc",
            "tandem.kv.transports.inline",
            "tandem.kv.transports.nixl",
            "tandem.kv.transports.shm",
        ),
        "each kind (NIXL optional) loaded only when configured",
    ),
    "tandem.model.info": (
        ("tandem.model.gguf_meta",),
        "GGUF reading only for a GGUF model",
    ),
    "tandem.model.loader": (
        ("tandem.model.gguf_loader",),
        "GGUF reading (the gguf package) only for a GGUF file",
    ),
    "tandem.quant.cli": (
        (
            "tandem.formats.weight",
            "tandem.model.loader",
            "tandem.model.quantized_checkpoint",
            "tandem.quant.checkpoint",
            "tandem.quant.profile",
            "tandem.quant.recipe",
        ),
        "`tandem quantize` subcommands, each loaded when run",
    ),
    "tandem.quant.e2e": (
        ("tandem.kv.cache", "tandem.model.llama"),
        "the offline tool runs the model; imported only by its pipeline",
    ),
    "tandem.quant.pipeline": (
        (
            "tandem.formats.weight",
            "tandem.quant.autoround",
            "tandem.quant.awq",
            "tandem.quant.e2e",
            "tandem.quant.gptq",
            "tandem.quant.recipe",
        ),
        "one calibration method loaded per recipe step",
    ),
    "bench.e2e_speed": (
        ("tandem.formats.weight", "tandem.model.config", "tandem.quant.e2e", "tandem.quant.recipe"),
        "benchmark: torch and the model loaded for the run, not for --help",
    ),
    "bench.engine_cpu": (
        ("tandem", "tandem.model.info"),
        "benchmark: torch and the model loaded for the run, not for --help",
    ),
    "bench.external_quant": (
        (
            "bench.decode_roofline",
            "tandem.config",
            "tandem.engine.llm_engine",
            "tandem.model.config",
            "tandem.model.loader",
        ),
        "benchmark: torch and the model loaded for the run, not for --help",
    ),
    "bench.gate": (
        (
            "bench.llama_random",
            "bench.serve",
            "tandem",
            "tandem.config",
            "tandem.engine.llm_engine",
            "tandem.formats.weight",
            "tandem.model.config",
            "tandem.model.layer_names",
            "tandem.model.loader",
        ),
        "each gate row loads its benchmark (after putting bench/ on sys.path) when run",
    ),
    "bench.goodput": (
        (
            "bench.llama_random",
            "tandem.config",
            "tandem.model.info",
            "tandem.rpc.api_pb2",
            "tandem.rpc.api_pb2_grpc",
        ),
        "torch only for a random checkpoint; gRPC stubs for the run",
    ),
    "bench.llama_random": (
        (
            "tandem.api.sampling_params",
            "tandem.config",
            "tandem.engine.cuda_graphs",
            "tandem.engine.llm_engine",
            "tandem.engine.roofline",
            "tandem.model.config",
            "tandem.model.loader",
        ),
        "imported by scripts before they put the repository root on sys.path",
    ),
    "bench.nixl_read": (
        (
            "tandem.kv.block_copy",
            "tandem.kv.cache",
            "tandem.kv.layout",
            "tandem.kv.transports.nixl",
            "tandem.kv.transports.shm",
        ),
        "NIXL is optional: loaded in the child that runs the read",
    ),
    "bench.profile_decode": (
        (
            "tandem.engine.llm_engine",
            "tandem.formats.weight",
            "tandem.model.config",
            "tandem.model.layer_names",
            "tandem.model.loader",
        ),
        "benchmark: torch and the model loaded for the run, not for --help",
    ),
    "bench.quant_h200": (
        (
            "tandem.config",
            "tandem.engine.llm_engine",
            "tandem.formats.weight",
            "tandem.kernels.argmax",
            "tandem.kernels.pdl",
            "tandem.kv.cache",
            "tandem.model.config",
            "tandem.model.layer_names",
            "tandem.model.llama",
            "tandem.model.loader",
            "tandem.model.synthetic",
        ),
        "benchmark: each measurement loads what it runs",
    ),
    "bench.serve": (
        (
            "bench.goodput",
            "bench.kv_tier",
            "bench.llama_random",
            "tandem",
            "tandem.model.info",
            "tandem.rpc.api_pb2",
            "tandem.rpc.api_pb2_grpc",
        ),
        "--workload subcommands (goodput, kv_tier) and torch / the engine only for the paths "
        "that run them",
    ),
    "bench.structured": (
        (
            "tandem",
            "tandem.api.sampling_params",
            "tandem.engine.async_step",
            "tandem.model.info",
            "tandem.model.tokenizer",
        ),
        "benchmark: torch and the model loaded for the run, not for --help",
    ),
    "bench.throughput": (
        (
            "bench.serve",
            "bench.timeline",
            "tandem.api.sampling_params",
            "tandem.rpc.api_pb2",
            "tandem.rpc.api_pb2_grpc",
        ),
        "the services and timeline modes load their modules when chosen",
    ),
    "bench.transfer": (
        ("tandem.kv.block_copy", "tandem.kv.cache"),
        "benchmark: torch and the KV pool loaded for the run, not for --help",
    ),
}

# Serving-path packages: they read the run-time formats (tandem/formats/) and import nothing of
# the offline quantization tool (tandem/quant/: calibration, recipes, checkpoint writing, its CLI) at
# module level; it sits above the model.
BELOW_QUANT = (
    "tandem.kernels",
    "tandem.kv",
    "tandem.layers",
    "tandem.model",
    "tandem.engine",
    "tandem.formats",
)


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    in_function: bool


def project_modules() -> dict[str, str]:
    """Dotted module name -> file path, for every module of the project packages."""
    mods = {}
    for pkg in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, pkg)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for fn in sorted(filenames):
                if not fn.endswith(".py"):
                    continue
                path = os.path.join(dirpath, fn)
                parts = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                mods[".".join(parts)] = path
    return mods


MODULES = project_modules()


def resolve(name: str) -> str | None:
    """The project module a dotted import name loads (`a.b.C` -> `a.b`), or None."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def imports_of(module: str) -> list[Import]:
    """The project modules `module` imports, each with where the import runs."""
    path = MODULES[module]
    is_package = path.endswith("__init__.py")
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = module if is_package else module.rpartition(".")[0]
    # A bench script runs with bench/ on sys.path, so `import serve` means bench/serve.py.
    script_dir = package if module.startswith("bench.") else None
    found: list[Import] = []

    def add(name: str, line: int, in_function: bool) -> None:
        target = resolve(name)
        if target is None and script_dir is not None:
            target = resolve(f"{script_dir}.{name}")
        if target is not None and target != module:
            found.append(Import(module, target, line, in_function))

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit_one(sub, in_function)
                continue
            visit_one(child, in_function)

    def visit_one(child: ast.AST, in_function: bool) -> None:
        if isinstance(child, ast.Import):
            for a in child.names:
                add(a.name, child.lineno, in_function)
        elif isinstance(child, ast.ImportFrom):
            if child.level:
                base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                mod = ".".join(base + ([child.module] if child.module else []))
            else:
                mod = child.module or ""
            for a in child.names:
                add(f"{mod}.{a.name}", child.lineno, in_function)
        inner = in_function or isinstance(
            child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
        )
        visit(child, inner)

    visit(tree, False)
    return found


ALL_IMPORTS = [imp for m in MODULES for imp in imports_of(m)]


def module_graph(with_functions: bool = False) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in ALL_IMPORTS:
        if with_functions or not imp.in_function:
            graph[imp.importer].add(imp.target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return path[path.index(t) :] + [t]
            if t not in state and (cycle := dfs(t)) is not None:
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := dfs(m)) is not None:
            return cycle
    return None


def test_no_import_cycle() -> None:
    cycle = find_cycle(module_graph())
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_no_loop_closed_inside_a_function() -> None:
    cycle = find_cycle(module_graph(with_functions=True))
    assert cycle is None, "import loop (closed inside a function): " + " -> ".join(cycle)


def test_function_level_imports_are_allowed() -> None:
    unexplained = [
        f"{os.path.relpath(MODULES[i.importer], ROOT)}:{i.line} imports {i.target}"
        for i in ALL_IMPORTS
        if i.in_function and i.target not in FUNCTION_LEVEL.get(i.importer, ((), ""))[0]
    ]
    assert not unexplained, (
        "function-level imports of project modules not in FUNCTION_LEVEL (import at the top, "
        "or add the module with its reason):\n  " + "\n  ".join(unexplained)
    )


def test_allow_list_is_current() -> None:
    used = {(i.importer, i.target) for i in ALL_IMPORTS if i.in_function}
    stale = [
        f"{importer} -> {t}"
        for importer, (targets, _) in FUNCTION_LEVEL.items()
        for t in targets
        if (importer, t) not in used
    ]
    assert not stale, "FUNCTION_LEVEL entries no longer used: " + ", ".join(stale)
    assert all(reason.strip() for _, reason in FUNCTION_LEVEL.values())


def test_serving_path_does_not_import_quant_tool() -> None:
    up = [
        f"{os.path.relpath(MODULES[i.importer], ROOT)}:{i.line} imports {i.target}"
        for i in ALL_IMPORTS
        if not i.in_function
        and i.importer.startswith(BELOW_QUANT)
        and (i.target == "tandem.quant" or i.target.startswith("tandem.quant."))
    ]
    assert not up, "module-level import of tandem.quant below it:\n  " + "\n  ".join(up)


def test_formats_are_at_the_bottom() -> None:
    up = [
        f"{os.path.relpath(MODULES[i.importer], ROOT)}:{i.line} imports {i.target}"
        for i in ALL_IMPORTS
        if i.importer.startswith("tandem.formats") and not i.target.startswith("tandem.formats")
    ]
    assert not up, "tandem/formats/ imports the rest of tandem:\n  " + "\n  ".join(up)


def test_config_imports_no_rpc() -> None:
    rpc = [
        i
        for i in ALL_IMPORTS
        if i.importer == "tandem.config" and i.target.startswith("tandem.rpc")
    ]
    assert not rpc, f"tandem/config.py imports {sorted({i.target for i in rpc})}"


def test_config_holds_declarations_only() -> None:
    # What turns a setting into something else (a torch device, a context length) lives with
    # its users; config.py stays a list of settings a reader can take in.
    with open(MODULES["tandem.config"], encoding="utf-8") as f:
        lines = sum(1 for _ in f)
    assert lines < 350, f"tandem/config.py has {lines} lines; keep it under 350"
