#!/bin/bash
check() {
  printf '10\n-2\n5\n' > /tmp/t1.txt
  [ "$(bash /app/sum.sh /app/numbers.txt)" = "15" ] && [ "$(bash /app/sum.sh /tmp/t1.txt)" = "13" ]
}
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
