"""schemathesis's hook module for `test_fuzz_http` (named by ``SCHEMATHESIS_HOOKS``): every
200 of a generation endpoint keeps its constraint's promise (`constrained.violation`)."""

from __future__ import annotations

import json
from typing import Any

import schemathesis
from constrained import streamed_choices, violation


@schemathesis.check
def constrained_output_validates(ctx: Any, response: Any, case: Any) -> bool | None:
    body = case.body
    if response.status_code != 200 or not isinstance(body, dict):
        return None
    if not case.path.endswith("completions"):
        return None
    if "text/event-stream" in response.headers.get("content-type", [""])[0]:
        lines = [ln[6:] for ln in response.text.splitlines() if ln.startswith("data: ")]
        choices = streamed_choices([json.loads(ln) for ln in lines if ln != "[DONE]"])
    else:
        choices = json.loads(response.text)["choices"]
    for choice in choices:
        if problem := violation(body, choice):
            raise AssertionError(f"choice {choice.get('index')}: {problem}")
    return True
