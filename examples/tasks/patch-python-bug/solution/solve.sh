#!/bin/bash
python3 - <<'EOF'
src = open("/app/stats.py").read()
src = src.replace(
    "    return s[len(s) // 2]\n",
    "    n = len(s)\n"
    "    if n % 2:\n"
    "        return s[n // 2]\n"
    "    return (s[n // 2 - 1] + s[n // 2]) / 2\n",
)
open("/app/stats.py", "w").write(src)
EOF
