#!/bin/bash
awk '$3 == "ERROR"' /app/logs/app.log > /app/errors.txt
wc -l < /app/errors.txt > /app/error_count.txt
