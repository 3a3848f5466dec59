#!/bin/bash
check() {
  python3 -c '
import json, sys
c = json.load(open("/app/config/service.json"))
sys.exit(0 if c == {"port": 8080, "debug": False, "hosts": ["alpha", "beta"]} and type(c["port"]) is int else 1)
' 2>/dev/null
}
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
