#!/bin/bash
# Partial credit: one point per top-level key, written as reward.json.
python3 - <<'EOF'
import json
want = {"name": "svc", "retries": 5, "db": {"host": "db.internal", "port": 5432}, "tags": ["b", "c"]}
try:
    got = json.load(open("/app/merged.json"))
except Exception:
    got = {}
ok = sum(1 for k in want if isinstance(got, dict) and got.get(k) == want[k])
json.dump({"reward": ok / len(want), "exact": float(got == want)},
          open("/logs/verifier/reward.json", "w"))
EOF
