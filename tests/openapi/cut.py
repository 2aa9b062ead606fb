"""Cut OpenAI's OpenAPI document down to the operations the gateway serves, with every component they
reference (transitively), into ``openai-subset.json`` beside this file.

    .venv/bin/python -m tests.openapi.cut PATH/TO/openai-openapi [--out FILE]

PATH is a checkout of https://github.com/openai/openai-openapi (its ``openapi.json``; ``COMMIT`` there,
when present, holds the commit id and date the README records). The document's ``servers`` is set to
the gateway's ``/v1`` base; the operations' ``x-oaiMeta`` (code samples for the reference pages) is
left out. Nothing else is changed: the schemas are OpenAI's as published.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
OPERATIONS = [
    ("/models", "get"),
    ("/models/{model}", "get"),
    ("/chat/completions", "post"),
    ("/completions", "post"),
    ("/embeddings", "post"),
    ("/responses", "post"),
]
_REF = re.compile(r"^#/components/([^/]+)/(.+)$")


def _refs(node: Any) -> list[tuple[str, str]]:
    """The components ``node`` refers to, as (section, name)."""
    found: list[tuple[str, str]] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            ref = n.get("$ref")
            if isinstance(ref, str):
                m = _REF.match(ref)
                if m is None:
                    raise ValueError(f"{ref} is not a reference to a component; this script follows only those")
                found.append((m[1], m[2].replace("~1", "/").replace("~0", "~")))
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return found


def cut(document: dict[str, Any]) -> dict[str, Any]:
    """The document with only :data:`OPERATIONS` and the components they reach."""
    paths: dict[str, dict[str, Any]] = {}
    for path, method in OPERATIONS:
        operation = {k: v for k, v in document["paths"][path][method].items() if k != "x-oaiMeta"}
        paths.setdefault(path, {})[method] = operation
    components: dict[str, dict[str, Any]] = {}
    todo = _refs(paths)
    while todo:
        section, name = todo.pop()
        if name in components.get(section, {}):
            continue
        try:
            value = document["components"][section][name]
        except KeyError:
            raise ValueError(f"#/components/{section}/{name} is referenced but not in the document") from None
        components.setdefault(section, {})[name] = value
        todo.extend(_refs(value))
    if "securitySchemes" in document.get("components", {}):
        components["securitySchemes"] = {"ApiKeyAuth": document["components"]["securitySchemes"]["ApiKeyAuth"]}
    ordered = {s: dict(sorted(c.items())) for s, c in sorted(components.items())}
    return {
        "openapi": document["openapi"],
        "info": document["info"],
        "servers": [{"url": "/v1", "description": "the llmgw gateway's OpenAI-compatible base"}],
        "security": [{"ApiKeyAuth": []}],
        "paths": paths,
        "components": ordered,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a checkout of openai/openai-openapi")
    parser.add_argument("--out", type=Path, default=HERE / "openai-subset.json")
    args = parser.parse_args()
    document = json.loads((args.checkout / "openapi.json").read_text())
    subset = cut(document)
    args.out.write_text(json.dumps(subset, indent=1, ensure_ascii=False) + "\n")
    n = sum(len(c) for c in subset["components"].values())
    print(f"{args.out}: {len(OPERATIONS)} operations, {n} components")


if __name__ == "__main__":
    main()
