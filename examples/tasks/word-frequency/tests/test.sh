#!/bin/bash
check() { [ "$(cat /app/top.txt 2>/dev/null)" = "$(printf 'the 4\ndog 4\ncat 3')" ] || [ "$(cat /app/top.txt 2>/dev/null)" = "$(printf 'dog 4\nthe 4\ncat 3')" ]; }
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
