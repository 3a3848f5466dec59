#!/bin/bash
check() {
  [ "$(cat /app/error_count.txt 2>/dev/null | tr -d ' \n')" = "3" ] &&
  [ "$(cat /app/errors.txt 2>/dev/null)" = "$(printf '2026-01-01 10:00:01 ERROR disk full\n2026-01-01 10:00:03 ERROR timeout talking to db\n2026-01-01 10:00:05 ERROR retry failed')" ]
}
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
