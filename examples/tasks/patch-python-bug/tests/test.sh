#!/bin/bash
check() { cd /app && python3 /tests/test_stats.py; }
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
