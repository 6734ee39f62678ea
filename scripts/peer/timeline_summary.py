"""Sums a strata timeline (Chrome trace JSON, `--timeline-step`) by thread,
category and name: where a step's time went, largest first.

    python3 scripts/peer/timeline_summary.py timeline-step-6.json [TOP] [THREAD]

THREAD keeps one thread's spans (`gpu`: the GPU's own time for each
dense operation, from CUDA events; `main`: the host's).
"""
import collections
import json
import sys

trace = json.load(open(sys.argv[1]))
top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
events = trace["traceEvents"] if isinstance(trace, dict) else trace
threads = {e["tid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "thread_name"}
spans = [e for e in events if e.get("ph") == "X"]
if len(sys.argv) > 3:
    spans = [e for e in spans if threads.get(e["tid"], str(e["tid"])) == sys.argv[3]]
total = collections.defaultdict(float)
count = collections.Counter()
for e in spans:
    key = (threads.get(e["tid"], str(e["tid"])), e.get("cat", ""), e["name"])
    total[key] += e["dur"] / 1e6
    count[key] += 1
if spans:
    start = min(e["ts"] for e in spans)
    end = max(e["ts"] + e["dur"] for e in spans)
    print(f"span of the trace: {(end - start) / 1e6:.3f} s")
for key, seconds in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
    print(f"{seconds:9.4f} s  {count[key]:5d}x  {' / '.join(key)}")
