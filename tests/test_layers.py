"""The package's layers import one way, down: no package imports one that imports it back, and
the memory core imports nothing outside itself (so it stays pure Python, tested in
milliseconds).  Every import counts, including ones inside functions and under TYPE_CHECKING:
a lazy import is still a dependency."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pagedllm"

# Lowest first.  A unit is a subpackage (core, layers, ...) or a top-level module (config, engine,
# ...).  A unit may import units of a lower rank only; units of one rank do not import each other.
RANKS: list[set[str]] = [
    {"core", "cache_dir", "errors", "child_process"},  # requests, blocks, scheduling; caches; errors; child env
    {"text", "config", "layers"},  # tokenizer; engine settings; kernels and layer math
    {"models"},  # architectures built from layers
    {"execution"},  # a step's tensors, the model on its device, sampling
    {"distributed"},  # tensor-parallel ranks around the execution layer
    {"engine", "cli_args"},  # the step loop; engine flags from EngineConfig
    {"llm", "serving", "benchmarking"},  # offline API, HTTP server, benchmarks
    {"replicas"},  # data-parallel replicas behind one endpoint, and their router
    {"pagedllm"},  # the package's own exports (LLM, SamplingParams, ...)
    {"testing"},  # transformers references and test servers, for the tests and the benchmarks
    {"cli"},  # the `pagedllm` command
    {"__main__"},  # python -m pagedllm
]


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    module, is_package = module_name(path), path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
    return {name for name in found if name == "pagedllm" or name.startswith("pagedllm.")}


def import_graph() -> dict[str, dict[str, list[str]]]:
    """unit -> imported unit -> the files that import it."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(PACKAGE.rglob("*.py")):
        source = unit_of(module_name(path))
        for target in {unit_of(name) for name in imported_modules(path)} - {source}:
            graph[source][target].append(str(path.relative_to(PACKAGE.parent)))
    return graph


def test_every_unit_has_a_rank():
    units = {unit_of(module_name(path)) for path in PACKAGE.rglob("*.py")}
    ranked = set().union(*RANKS)
    assert units <= ranked, f"give these a place in RANKS: {sorted(units - ranked)}"


def test_no_package_imports_one_that_imports_it_back():
    graph = import_graph()
    cycles = []

    def walk(unit: str, path: list[str]) -> None:
        for target in graph.get(unit, {}):
            if target == path[0]:
                cycles.append(" -> ".join([*path, target]))
            elif target not in path and len(path) < len(graph):
                walk(target, [*path, target])

    for unit in graph:
        walk(unit, [unit])
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))


def test_core_imports_nothing_outside_itself():
    outside = {target: files for target, files in import_graph().get("core", {}).items()}
    assert not outside, f"core imports {outside}"


def test_imports_point_down():
    rank = {unit: i for i, units in enumerate(RANKS) for unit in units}
    upward = [
        f"{source} -> {target} ({', '.join(files)})"
        for source, targets in import_graph().items()
        for target, files in targets.items()
        if target in rank and source in rank and rank[target] >= rank[source]
    ]
    assert not upward, "imports that do not point down:\n" + "\n".join(upward)


@pytest.mark.parametrize("module", ["block_pool", "kv_cache_manager", "scheduler", "request"])
def test_the_memory_core_needs_no_torch(module):
    """Import-level check: none of the core's modules names torch, even lazily."""
    names: set[str] = set()
    for node in ast.walk(ast.parse((PACKAGE / "core" / f"{module}.py").read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    assert "torch" not in names and "numpy" not in names


def test_importing_pagedllm_and_its_memory_core_loads_no_torch():
    """At run time, not only by the import statements: `import pagedllm` loads its public names
    on first use, so the memory core, the settings and the sampling parameters come without
    torch; asking for `LLM` brings it."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import pagedllm\n"
        "import pagedllm.core.block_pool, pagedllm.core.kv_cache_manager, pagedllm.core.scheduler\n"
        "from pagedllm import EngineConfig, RequestOutput, SamplingParams, StructuredOutput\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "from pagedllm import LLM\n"
        "assert 'torch' in sys.modules and LLM.__name__ == 'LLM'\n"
        "try:\n"
        "    pagedllm.NoSuchName\n"
        "except AttributeError as error:\n"
        "    assert 'NoSuchName' in str(error)\n"
        "else:\n"
        "    raise AssertionError('no error for an unknown name')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=PACKAGE.parent, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]


# The engine's parts: only engine/ (and the layers below it, which the engine assembles) reads
# them; everything above goes through LLMEngine's own methods and EngineInfo.  testing/ builds
# transformers references by driving the runner and cache directly, on purpose.
ENGINE_PARTS = {"scheduler", "kv_cache", "runner", "output_processor", "intake", "table", "memory", "stats", "workers"}
INSIDE_THE_ENGINE = ("engine/", "core/", "execution/", "distributed/", "testing/")


# Benchmarks that time or swap one inner part (they are profilers of the engine, not its users):
# the step's phases and kernels, the one-call decode step, CUDA graphs, tensor-parallel messages,
# speculation switched per run on one engine, grammar masks, a workload's time by kind of step.
WHITE_BOX_BENCHMARKS = {
    "step_profile.py",
    "step_kinds.py",
    "fused_decode.py",
    "gpu_check.py",
    "tensor_parallel.py",
    "speculative.py",
    "structured_output.py",
}


def test_no_module_above_the_engine_reads_its_parts():
    reads = []
    sources = [(path, path.relative_to(PACKAGE).as_posix()) for path in sorted(PACKAGE.rglob("*.py"))]
    benchmarks = sorted((PACKAGE.parent / "benchmarks").glob("*.py"))
    sources += [(path, f"benchmarks/{path.name}") for path in benchmarks if path.name not in WHITE_BOX_BENCHMARKS]
    for path, name in sources:
        if name.startswith(INSIDE_THE_ENGINE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = ast.unparse(node.value).split(".")[-1]
            # engine.scheduler, self.engine.kv_cache, ...; and AsyncLLMEngine's engine.engine
            if owner == "engine" and (node.attr in ENGINE_PARTS or node.attr == "engine"):
                reads.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert reads == [], "go through LLMEngine's methods or EngineInfo:\n" + "\n".join(reads)


def test_models_are_math_without_kernel_plumbing():
    """Which kernels run (the one-call decode step, the quantized projections' setup, the C++
    kernels) is chosen in execution/; a model file holds its layers' math and weight names."""
    plumbing = {"pagedllm.layers.cpu_kernels", "pagedllm.layers.fused_decode"}
    found = []
    for path in sorted((PACKAGE / "models").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {alias.name for alias in node.names}
                if node.module in plumbing or "QuantizedSetup" in names or "CpuKernels" in names:
                    found.append(f"{path.name}:{node.lineno}: from {node.module} import {', '.join(sorted(names))}")
            if isinstance(node, ast.Compare) and "type(self)" in ast.unparse(node):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)} (declare it instead)")
    assert found == [], "\n".join(found)
