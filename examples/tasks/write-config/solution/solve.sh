#!/bin/bash
mkdir -p /app/config
cat > /app/config/service.json <<'EOF'
{"port": 8080, "debug": false, "hosts": ["alpha", "beta"]}
EOF
