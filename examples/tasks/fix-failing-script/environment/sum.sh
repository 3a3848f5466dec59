#!/bin/bash
# Sums the integers in "$1", one per line.
total=0
while read -r n; do
  total=$n
done < "$1"
echo "$total"
