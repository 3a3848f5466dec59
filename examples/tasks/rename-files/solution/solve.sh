#!/bin/bash
cd /app/photos
for f in *.JPG; do mv -- "$f" "${f%.JPG}.jpg"; done
