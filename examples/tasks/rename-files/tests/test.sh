#!/bin/bash
check() {
  [ "$(cd /app/photos && ls | sort | tr '\n' '|')" = "City Night.jpg|beach.jpg|cat.jpg|notes.txt|" ] &&
  [ "$(cat '/app/photos/City Night.jpg')" = "c" ]
}
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
