#!/bin/bash
check() { [ "$(cat /app/out/reversed.txt 2>/dev/null)" = "$(printf 'xobdnas olleh\nseed-42')" ]; }
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
