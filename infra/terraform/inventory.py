"""Static inventory of the Terraform modules, printed as JSON for tests/ops (run with .venv-tools/bin/python).

`terraform validate` needs provider plugins from the registry, which is out of reach offline, so the tests
check what can be checked without them: every file parses (python-hcl2, the parser checkov uses), every
variable and output is documented, module calls match module interfaces, references resolve.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import hcl2

ROOT = Path(__file__).resolve().parent
_REF = {
    "var": re.compile(r"\bvar\.([A-Za-z_][\w-]*)"),
    "local": re.compile(r"\blocal\.([A-Za-z_][\w-]*)"),
    "module": re.compile(r"\bmodule\.([A-Za-z_][\w-]*)\.([A-Za-z_][\w-]*)"),
}
_META_ARGS = {"source", "version", "providers", "count", "for_each", "depends_on"}


def _strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield str(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for item in node:
            yield from _strings(item)


def _first(value):
    return value[0] if isinstance(value, list) and value else value


def module_inventory(directory: Path) -> dict:
    inv = {
        "files": [], "variables": {}, "outputs": {}, "module_calls": {}, "resources": [], "data": [],
        "locals": [], "required_providers": {}, "refs": {"var": [], "local": [], "module": []},
    }
    for tf in sorted(directory.glob("*.tf")):
        with tf.open() as fh:
            parsed = hcl2.load(fh)
        inv["files"].append(tf.name)
        for block in parsed.get("variable", []):
            for name, body in block.items():
                inv["variables"][name] = {
                    "description": _first(body.get("description")),
                    "type": _first(body.get("type")),
                    "has_default": "default" in body,
                    "sensitive": bool(_first(body.get("sensitive", [False]))),
                    "validations": len(body.get("validation", [])),
                }
        for block in parsed.get("output", []):
            for name, body in block.items():
                inv["outputs"][name] = {"description": _first(body.get("description")),
                                        "sensitive": bool(_first(body.get("sensitive", [False])))}
        for block in parsed.get("module", []):
            for name, body in block.items():
                inv["module_calls"][name] = {
                    "source": _first(body.get("source")),
                    "arguments": sorted(k for k in body if k not in _META_ARGS and not k.startswith("__")),
                }
        for kind in ("resource", "data"):
            for block in parsed.get(kind, []):
                for rtype, named in block.items():
                    for rname in named:
                        inv["resources" if kind == "resource" else "data"].append(f"{rtype}.{rname}")
        for block in parsed.get("locals", []):
            inv["locals"].extend(k for k in block if not k.startswith("__"))
        for block in parsed.get("terraform", []):
            for providers in block.get("required_providers", []):
                for pname, spec in providers.items():
                    inv["required_providers"][pname] = spec
        for text in _strings(parsed):
            for kind, pattern in _REF.items():
                for match in pattern.finditer(text):
                    inv["refs"][kind].append(list(match.groups()) if kind == "module" else match.group(1))
    inv["refs"] = {k: sorted({json.dumps(v) for v in vs}) for k, vs in inv["refs"].items()}
    inv["refs"] = {k: [json.loads(v) for v in vs] for k, vs in inv["refs"].items()}
    return inv


def inventory(root: Path = ROOT) -> dict:
    dirs = sorted(p.parent for p in root.rglob("*.tf") if ".terraform" not in p.parts)
    return {str(d.relative_to(root)): module_inventory(d) for d in dict.fromkeys(dirs)}


if __name__ == "__main__":
    json.dump(inventory(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT), sys.stdout, indent=1, default=str)
