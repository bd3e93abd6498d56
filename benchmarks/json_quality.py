"""JSON-schema replies from SmolLM2 at temperature 0.7: of the replies that end with "stop", how many
parse, validate against the schema, and keep its property order.

    python benchmarks/json_quality.py
"""

import collections
import json

import jsonschema

from pagedllm import LLM, SamplingParams
from pagedllm.core.sampling_params import StructuredOutput

schema = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"task": {"type": "string"}, "done": {"type": "boolean"}},
                "required": ["task", "done"],
            },
        },
        "owner": {"type": "string"},
        "priority": {"type": "integer"},
    },
    "required": ["items", "owner", "priority"],
}
llm = LLM()
prompts = [
    llm.tokenizer.apply_chat_template([{"role": "user", "content": f"Make a to-do list for day {i} as JSON."}])
    for i in range(60)
]
params = [
    SamplingParams(temperature=0.7, max_tokens=200, seed=i, structured_output=StructuredOutput(json_schema=schema))
    for i in range(60)
]
outs = llm.generate(prompts, params)


def in_order(v):
    top = [k for k in v if k in schema["properties"]] == ["items", "owner", "priority"]
    return top and all([k for k in it if k in ("task", "done")] == ["task", "done"] for it in v["items"])


stop = [o for o in outs if o.finish_reason == "stop"]
valid = ordered = 0
for o in stop:
    try:
        v = json.loads(o.text)
        jsonschema.validate(v, schema)
        valid += 1
        ordered += in_order(v)
    except Exception:
        print("bad", repr(o.text[:200]))
print(
    collections.Counter(o.finish_reason for o in outs),
    f"valid {valid}/{len(stop)} of those ending with stop; schema order {ordered}/{valid}",
)
