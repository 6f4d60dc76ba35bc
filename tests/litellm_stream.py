"""A client stream through LiteLLM's Router, run by the litellm venv's interpreter (so this file
imports only what that venv has): a request every 0.1 s to MODEL until STOP exists, each line
of PROGRESS one answered request, RESULTS the (outcome, wait) of each at the end.

usage: litellm_stream.py CONFIG.json MODEL STOP PROGRESS RESULTS
"""

import json
import os
import sys
import threading
import time

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch: offline

import litellm
from litellm import Router

litellm.telemetry = False
config_path, model, stop, progress, results_path = sys.argv[1:6]
with open(config_path) as f:
    config = json.load(f)
router = Router(model_list=config["model_list"], **config.get("router_settings", {}))
results = []
lock = threading.Lock()


def one() -> None:
    began = time.monotonic()
    try:
        reply = router.completion(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1, stream=True
        )
        text = "".join((c.choices[0].delta.content or "") for c in reply)
        outcome = "ok" if text else "empty"
    except Exception as exc:  # each failure counted, by its kind
        outcome = type(exc).__name__
    with lock:
        results.append((outcome, time.monotonic() - began))
        with open(progress, "a") as f:
            f.write(outcome + "\n")


threads = []
while not os.path.exists(stop):
    t = threading.Thread(target=one)
    t.start()
    threads.append(t)
    time.sleep(0.1)
for t in threads:
    t.join(120)
with open(results_path, "w") as f:
    json.dump(results, f)
