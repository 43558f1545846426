# shmrun: none
"""The Python package's modules stay in layers (issue 22; docs/ARCHITECTURE.md,
"Layers"): each imports only modules of lower layers, at its top or inside
a function, so no import circle can come back. Fails naming the module,
the one it imports and the line."""
import ast
import os

import shmrpc

# Lowest first; a module may import those of the layers before its own.
LAYERS = [
    {"_shmrpc", "constants"},
    {"options", "profiler", "server_profiler"},
    {"backend_registry", "_core"},
    {"_contexts"},
    {"_marshal"},
    {"_futures"},
    {"autograd"},
    {"_calls"},
    {"_serve", "optim"},
    {"api", "_rendezvous"},
    {"as_torch"},
    {"__init__"},
    {"_data_collate"},
    {"_data_worker"},
    {"_data_job"},
    {"_data_iter"},
    {"data"},
]
LEVEL = {m: i for i, layer in enumerate(LAYERS) for m in layer}
HERE = os.path.dirname(shmrpc.__file__)


def imports(path):
    """(module of the package imported, line) for every import in path."""
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                yield node.module.split(".")[0], node.lineno
            else:
                for alias in node.names:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == "shmrpc":
                if len(parts) > 1:
                    yield parts[1], node.lineno
                else:
                    for alias in node.names:
                        yield (alias.name if alias.name in LEVEL else "__init__"), node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "shmrpc":
                    yield (parts[1] if len(parts) > 1 else "__init__"), node.lineno


def test_every_module_has_a_layer():
    modules = {f[:-3] for f in os.listdir(HERE) if f.endswith(".py")} | {"_shmrpc"}
    assert modules == set(LEVEL), f"modules without a layer: {modules - set(LEVEL)}; " \
                                  f"layers without a module: {set(LEVEL) - modules}"


def test_imports_point_down():
    wrong = []
    for module in LEVEL:
        if module == "_shmrpc":
            continue
        path = os.path.join(HERE, module + ".py")
        for name, line in imports(path):
            if name not in LEVEL:
                wrong.append(f"{module}.py:{line} imports {name}, which has no layer")
            elif LEVEL[name] >= LEVEL[module]:
                wrong.append(f"{module}.py:{line} imports {name} (layer {LEVEL[name]}), "
                             f"not below its own layer {LEVEL[module]}")
    assert not wrong, "\n".join(wrong)
