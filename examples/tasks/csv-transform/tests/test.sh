#!/bin/bash
check() {
  [ "$(cat /app/totals.csv 2>/dev/null)" = "$(printf 'region,total\neast,10\nnorth,1\nwest,15')" ]
}
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
