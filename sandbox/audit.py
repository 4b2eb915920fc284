"""Pre-execution audit: list the imports and calls in recipe code that deserve a human look
(processes, network, native code, unpickling, dynamic code). Findings are reported, not refused:
trusted code may have good reasons; ``genkit inspect`` shows them before you decide to trust."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .imports import too_deep
from .tree import SourceTree

RISKY_MODULES = {
    "subprocess": "process", "pty": "process", "multiprocessing": "process",
    "socket": "network", "ssl": "network", "http.client": "network", "urllib.request": "network",
    "requests": "network", "httpx": "network", "urllib3": "network", "aiohttp": "network", "ftplib": "network",
    "ctypes": "native code", "cffi": "native code",
    "pickle": "deserialization", "cPickle": "deserialization", "dill": "deserialization",
    "marshal": "deserialization", "shelve": "deserialization", "joblib": "deserialization",
    "importlib": "dynamic code", "runpy": "dynamic code", "code": "dynamic code",
}
RISKY_CALLS = {
    "eval": "dynamic code", "exec": "dynamic code", "compile": "dynamic code", "__import__": "dynamic code",
    "importlib.import_module": "dynamic code", "importlib.__import__": "dynamic code",
    "os.system": "process", "os.popen": "process", "os.fork": "process", "os.kill": "process",
    "subprocess.run": "process", "subprocess.Popen": "process", "subprocess.call": "process",
    "subprocess.check_call": "process", "subprocess.check_output": "process",
    "socket.socket": "network", "socket.create_connection": "network",
    "pickle.load": "deserialization", "pickle.loads": "deserialization", "marshal.loads": "deserialization",
    "torch.load": "deserialization", "ctypes.CDLL": "native code", "ctypes.cdll.LoadLibrary": "native code",
    "shutil.rmtree": "filesystem", "os.remove": "filesystem", "os.unlink": "filesystem",
    "os.rmdir": "filesystem", "setattr": "dynamic code",
}
_PREFIX_CALLS = {"os.exec": "process", "os.spawn": "process", "os.posix_spawn": "process"}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    category: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.category}] {self.what}"


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def audit_module(path: str, module: ast.Module) -> list[Finding]:
    """Findings for one parsed file (``path`` is only used for display)."""
    findings: list[Finding] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(module):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                cat = RISKY_MODULES.get(a.name) or RISKY_MODULES.get(a.name.split(".")[0])
                if cat:
                    findings.append(Finding(path, node.lineno, cat, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            cat = RISKY_MODULES.get(node.module) or RISKY_MODULES.get(node.module.split(".")[0])
            if cat:
                findings.append(Finding(path, node.lineno, cat,
                                        f"from {node.module} import {', '.join(a.name for a in node.names)}"))
    for node in ast.walk(module):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None:
            continue
        head, _, rest = name.partition(".")
        full = aliases.get(head, head) + (f".{rest}" if rest else "")
        cat = RISKY_CALLS.get(full) or next((c for p, c in _PREFIX_CALLS.items() if full.startswith(p)), None)
        if cat == "dynamic code" and full == "setattr":
            continue  # too common to be useful
        if full == "torch.load" and any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
                                        and k.value.value is True for k in node.keywords):
            continue
        if cat:
            findings.append(Finding(path, node.lineno, cat, f"call {full}()"))
        elif full == "open" and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and any(c in node.args[1].value for c in "wax+"):
            findings.append(Finding(path, node.lineno, "filesystem", f"open(..., {node.args[1].value!r})"))
    return sorted(set(findings), key=lambda f: (f.path, f.line, f.what))


def audit_tree(tree: SourceTree, parsed: dict[str, ast.Module]) -> list[Finding]:
    """Findings for every parsed file of a recipe."""
    out: list[Finding] = []
    for rel in sorted(parsed):
        out.extend(audit_module(tree.display(rel), parsed[rel]))
    return out


def audit_sources(sources: dict[str, str]) -> list[Finding]:
    """Audit raw sources (display path -> text) without a SourceTree; unparsable files are skipped."""
    out: list[Finding] = []
    for path in sorted(sources):
        try:
            module = ast.parse(sources[path], filename=path)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        if too_deep(module) is None:
            out.extend(audit_module(path, module))
    return out
