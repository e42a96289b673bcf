"""One timed run of an A/B (train/apps/bench/ab.py): run as a script with a checkout first on its path, so that the
engine timed is that checkout's; it reads nothing else of this repository and prints one JSON line.

    python ab_run.py <checkout> <job.json>

job.json: {"drafter": "none" | a name or folder, "alone": bool (prompt lookup first off), "prompts": [[token ids]],
"max_new_tokens": int, "threads": int, "target": name or folder}.
"""

import hashlib
import importlib
import json
import sys
import time

checkout, job_file = sys.argv[1], sys.argv[2]
sys.path.insert(0, checkout)

import torch  # noqa: E402

job = json.loads(open(job_file).read())
torch.set_num_threads(job["threads"])
from infer import SelfSpecModel  # noqa: E402


def load_target(name: str):
    # the general loader moved from infer.embedded to infer.loading: a base revision may have either
    for module in ("infer.loading", "infer.embedded"):
        try:
            return importlib.import_module(module).resolve_target(name)
        except (ImportError, AttributeError):
            continue
    raise SystemExit(f"{checkout}: neither infer.loading nor infer.embedded has resolve_target")


target, tokenizer = load_target(job["target"])
if job["drafter"] == "none":
    model = SelfSpecModel(target, "none", tokenizer=tokenizer)
else:
    model = SelfSpecModel.from_pretrained(job["drafter"], target=target,
                                          **({"lookup_first": False} if job["alone"] else {}))
prompts = [torch.tensor([ids]) for ids in job["prompts"]]
with torch.inference_mode():
    model.generate(prompts[0], max_new_tokens=16)  # warm-up: first-call set-up is no step's cost
    seconds, new_tokens, forwards, outputs = 0.0, 0, 0, []
    for ids in prompts:
        tic = time.perf_counter()
        out = model.generate(ids, max_new_tokens=job["max_new_tokens"])
        seconds += time.perf_counter() - tic
        new_tokens += model.last_stats["new_tokens"]
        forwards += model.last_stats["target_forwards"]
        outputs.append(out[0, ids.shape[1]:].tolist())
print(json.dumps({"seconds": seconds, "new_tokens": new_tokens, "target_forwards": forwards,
                  "outputs": hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]}))
