#!/usr/bin/env python3
"""Reference renderer for tests/transport/test_chat_templates.cpp: renders chat templates with
jinja2 the way Hugging Face tokenizers do (transformers' _compile_jinja_template):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loopcontrols), globals
raise_exception and strftime_now, and a tojson filter that is json.dumps(ensure_ascii=False).

  render_ref.py CASES_JSON TEMPLATE...   ->  stdout: {"<template>": {"<case>": {"text"|"error": ...}}}

strftime_now formats a fixed date (2024-07-26 12:00:00) so the output is deterministic; the
C++ side injects the same instant. bos_token/eos_token, extra variables and the cases come from CASES_JSON."""
import datetime
import json
import sys

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

FIXED = datetime.datetime(2024, 7, 26, 12, 0, 0)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt):
    return FIXED.strftime(fmt)


def main():
    spec = json.load(open(sys.argv[1], encoding="utf-8"))
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    out = {}
    for path in sys.argv[2:]:
        results = {}
        try:
            tmpl = env.from_string(open(path, encoding="utf-8").read())
        except Exception as e:  # noqa: BLE001 - a template that does not parse fails every case
            out[path] = {c["name"]: {"error": f"{type(e).__name__}: {e}"} for c in spec["cases"]}
            continue
        for case in spec["cases"]:
            try:
                text = tmpl.render(messages=case["messages"], tools=case.get("tools"), documents=None,
                                   add_generation_prompt=case["add_generation_prompt"],
                                   bos_token=spec["bos_token"], eos_token=spec["eos_token"],
                                   **spec.get("extra", {}))
                results[case["name"]] = {"text": text}
            except Exception as e:  # noqa: BLE001 - the C++ renderer must fail too
                results[case["name"]] = {"error": f"{type(e).__name__}: {e}"}
        out[path] = results
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
