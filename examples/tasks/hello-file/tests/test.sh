#!/bin/bash
check() { [ "$(cat /app/hello.txt 2>/dev/null)" = "Hello, world!" ]; }
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
