"""The house's shape: one import package, `pardec`; every module under one name; no import loop
inside a service or between the verifier's rooms; no module over 400 lines; each of the two
wheels (the server's, and the light client's from client/) installs nothing beside `pardec`, and
the contract's stubs are in the client's only."""

import ast
import importlib
import pkgutil
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pardec

ROOT = Path(__file__).resolve().parent.parent
# The repository's folders and the subpackage each is installed as (pyproject's package-dir).
SUBPACKAGES = {
    "runtime": "pardec.runtime", "drafter": "pardec.drafter", "verifier": "pardec.verifier",
    "gateway": "pardec.gateway", "bench": "pardec.bench",
}
# The light client's distribution: the contract's generated code and pardec.client.
CLIENT = ROOT / "client"
GENERATED = CLIENT / "pardec" / "v1"
MAX_LINES = 400


def source_files() -> list[Path]:
    ignored = (ROOT / ".venv", GENERATED, ROOT / ".git")
    return sorted(p for p in ROOT.rglob("*.py") if not any(p.is_relative_to(i) for i in ignored))


def service_modules() -> dict[str, Path]:
    """Every module of the installed subpackages by its pardec.* name."""
    modules = {}
    for folder, package in SUBPACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def client_modules() -> dict[str, Path]:
    """Every module of the client's distribution by its pardec.* name."""
    modules = {}
    for path in sorted((CLIENT / "pardec").rglob("*.py")):
        parts = [p for p in path.relative_to(CLIENT).with_suffix("").parts if p != "__init__"]
        modules[".".join(parts)] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """Every name a module imports anywhere: at the top, inside functions, under TYPE_CHECKING."""
    names = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from package import module`
    return names


def import_graph() -> dict[str, set[str]]:
    modules = service_modules()
    return {m: {n for n in imported_names(m, p) if n in modules and n != m} for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycles_finds_a_loop_and_only_a_loop():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_code_imports_only_pardec():
    top_level = set(SUBPACKAGES) | {"protos"}
    wrong = []
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] in top_level]
    assert not wrong, "import these as pardec.*:\n" + "\n".join(wrong)


def test_no_import_loop_inside_a_service():
    graph = import_graph()
    for package in SUBPACKAGES.values():
        inside = {m: {n for n in targets if n.startswith(package + ".")}
                  for m, targets in graph.items() if m.startswith(package + ".") or m == package}
        assert cycles(inside) == [], f"import loop in {package}"


def test_the_verifiers_rooms_import_one_way():
    """verifier/'s rooms (kernels, model, prepare, engine; each top-level module its own) form no
    loop: the kernels know nothing of the model, the model nothing of its preparation or serving."""
    def room(module: str) -> str:
        return ".".join(module.split(".")[:3])

    rooms: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        if module.startswith("pardec.verifier."):
            rooms.setdefault(room(module), set()).update(
                room(t) for t in targets if t.startswith("pardec.verifier.") and room(t) != room(module))
    assert {"pardec.verifier.kernels", "pardec.verifier.model", "pardec.verifier.engine"} <= set(rooms)
    assert cycles(rooms) == []
    assert rooms["pardec.verifier.kernels"] == set()


def test_no_module_over_400_lines():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in source_files() if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"over {MAX_LINES} lines:\n" + "\n".join(long)


def test_no_module_is_loaded_under_two_names():
    """With the repository root on sys.path (as under pytest), `gateway.x` would load
    gateway/x.py a second time beside pardec.gateway.x: two module objects, two sets of globals."""
    for info in pkgutil.walk_packages(pardec.__path__, "pardec."):
        importlib.import_module(info.name)
    by_file: dict[str, list[str]] = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        path = Path(file).resolve() if file else None
        if path and path.is_relative_to(ROOT) and not path.is_relative_to(ROOT / ".venv"):
            by_file.setdefault(str(path), []).append(name)
    twice = {file: names for file, names in by_file.items() if len(names) > 1}
    assert not twice, f"loaded under two names: {twice}"


def test_the_light_client_imports_nothing_of_the_server():
    """pardec.client and pardec.v1 need grpcio and protobuf only: no torch, no service code."""
    # typing_extensions only under TYPE_CHECKING (Unpack on Python 3.10); grpcio requires it anyway.
    allowed = {"pardec", "grpc", "google", "typing_extensions", *sys.stdlib_module_names}
    wrong = [f"{module} imports {name}" for module, path in client_modules().items()
             for name in imported_names(module, path)
             if name.split(".")[0] not in allowed or name.startswith("pardec.") and
             name.split(".")[1] not in ("client", "v1")]
    assert not wrong, "\n".join(wrong)


def build_wheel(folder: Path, tmp_path: Path, name: str) -> tuple[set[str], list[str], str]:
    """The files of the wheel built from ``folder``, its Requires-Dist lines and its version."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(folder)], check=True)
    (wheel,) = tmp_path.glob(f"{name}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packaged = set(archive.namelist())
        (metadata,) = [n for n in packaged if n.endswith(".dist-info/METADATA")]
        lines = archive.read(metadata).decode().splitlines()
    requires = [line.removeprefix("Requires-Dist: ") for line in lines
                if line.startswith("Requires-Dist: ") and "extra ==" not in line]
    (version,) = [line.removeprefix("Version: ") for line in lines if line.startswith("Version: ")]
    tops = {n.split("/")[0] for n in packaged if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"pardec"}
    assert "pardec/__init__.py" not in packaged  # a namespace: the two distributions share it
    return packaged, requires, version


def wheel_paths(modules: dict[str, Path]) -> set[str]:
    return {"pardec/" + module.removeprefix("pardec.").replace(".", "/") + (
        "/__init__.py" if path.name == "__init__.py" else ".py") for module, path in modules.items()}


def test_the_wheels_install_only_pardec_and_the_stubs_once(tmp_path):
    # setuptools writes build/ beside pyproject.toml: copies, not the checkout.
    source, client = tmp_path / "source", tmp_path / "client"
    for folder in SUBPACKAGES:
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for file in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / file, source / file)
    shutil.copytree(CLIENT, client, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    server_files, server_requires, _ = build_wheel(source, tmp_path / "server-wheel", "pardec")
    client_files, client_requires, version = build_wheel(client, tmp_path / "client-wheel", "pardec_client")

    assert wheel_paths(service_modules()) - server_files == set()  # every subpackage is listed in pyproject
    for data in ("pardec/drafter/sessions.lua", "pardec/verifier/kernels/int8_linear.c"):
        assert data in server_files
    assert not [n for n in server_files if n.startswith(("pardec/v1/", "pardec/client/"))]

    assert wheel_paths(client_modules()) - client_files == set()
    for data in ("pardec/v1/gateway.proto", "pardec/v1/gateway_pb2.pyi", "pardec/client/py.typed"):
        assert data in client_files
    assert {n.split("/")[1] for n in client_files if n.startswith("pardec/")} == {"v1", "client"}
    assert sorted(re.split(r"[<>=!~ ;]", r)[0] for r in client_requires) == ["grpcio", "protobuf"]
    assert f"pardec-client=={version}" in server_requires  # the server runs on exactly this contract
