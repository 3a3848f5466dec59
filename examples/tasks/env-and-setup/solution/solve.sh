#!/bin/bash
{ echo "$GREETING" | rev; cat /app/data/seed.txt; } > /app/out/reversed.txt
