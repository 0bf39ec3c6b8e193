"""The layers read as the maths: public torch ops and the dispatch table's ops, no private
torch API, no environment read (the CPU numerics live in rwkv_clip/ops)."""
from __future__ import annotations

import ast
from pathlib import Path

import rwkv_clip.layers

LAYERS = Path(rwkv_clip.layers.__file__).parent


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def test_layers_use_no_private_torch_api_and_read_no_environment():
    offences = []
    for path in sorted(LAYERS.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                name = _dotted(node)
                private = any(p.startswith("_") for p in name.split(".")[1:])
                if name.startswith("torch.") and (private or name.startswith("torch.ops.")):
                    offences.append(f"{path.name}:{node.lineno} {name}")
                if name in ("os.environ", "os.getenv"):
                    offences.append(f"{path.name}:{node.lineno} {name}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch._"):
                offences.append(f"{path.name}:{node.lineno} from {node.module}")
            if isinstance(node, ast.Import) and any(a.name == "os" for a in node.names):
                offences.append(f"{path.name}:{node.lineno} import os")
    assert not offences, offences
    assert len(list(LAYERS.glob("*.py"))) >= 6  # the scan saw the layers
