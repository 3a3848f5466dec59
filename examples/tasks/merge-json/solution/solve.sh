#!/bin/bash
python3 - <<'EOF'
import json
def merge(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
d = json.load(open("/app/defaults.json"))
o = json.load(open("/app/overrides.json"))
json.dump(merge(d, o), open("/app/merged.json", "w"), indent=2)
EOF
